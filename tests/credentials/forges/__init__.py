"""Tests of services/credentials/forges/ (and what it is wired into)."""
