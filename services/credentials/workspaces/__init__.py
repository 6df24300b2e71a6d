"""A ticket's workspace on the host: prepare, capture, commit, checkouts and spares, where
a ticket continues from, and the handover across hosts."""
