"""Tests of services/credentials/relay/ (and what it is wired into)."""
