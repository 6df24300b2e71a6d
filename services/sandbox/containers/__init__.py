"""Docker objects of a ticket: the hardened settings, making, restarting and removing
containers, and what a sandbox is and was (the local images are services/common/host/images.py)."""
