"""Tests of services/sandbox/relays/ (and what it is wired into)."""
