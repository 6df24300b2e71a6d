"""Secrets in and out (R27, R28, R30, R33): reading them once, redacting them from text,
the environment every child process gets, and the UI token file (tokenfile.py)."""
