"""Clean-room verification (R41): the harness that decides how the commands run, and the
checkout of a head for it."""
