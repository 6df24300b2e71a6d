"""Tests of services/credentials/workspaces/ (and what it is wired into)."""
