"""Tests of services/credentials/fencing/ (and what it is wired into)."""
