"""Tests of services/credentials/mcptools/ (and what it is wired into)."""
