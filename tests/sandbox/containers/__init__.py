"""Tests of services/sandbox/containers/ (and what it is wired into)."""
