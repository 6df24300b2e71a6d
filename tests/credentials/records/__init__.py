"""Tests of services/credentials/records/ (and what it is wired into)."""
