"""Tests of services/sandbox/files/ (and what it is wired into)."""
