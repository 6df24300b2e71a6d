"""Tests of services/credentials/git/ (and what it is wired into)."""
