"""Tests of services/credentials/models/ (and what it is wired into)."""
