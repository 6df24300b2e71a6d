"""Docker objects of a ticket: the hardened settings, making, restarting and removing
containers, the local images, and what a sandbox is and was."""
