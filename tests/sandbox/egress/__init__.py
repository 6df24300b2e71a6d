"""Tests of services/sandbox/egress/ (and what it is wired into)."""
