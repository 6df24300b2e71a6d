"""Tests of services/credentials/verification/ (and what it is wired into)."""
