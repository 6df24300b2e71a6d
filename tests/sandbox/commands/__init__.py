"""Tests of services/sandbox/commands/ (and what it is wired into)."""
