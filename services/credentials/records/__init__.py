"""The broker's signing key and the run records it signs (R42)."""
