"""The tickets' lives: creating and validating tickets, capacity and the
dispatcher (core.py), a person's decisions (approvals.py), leases between
schedulers (leases.py), re-opening and follow-ups (reopen.py, followups.py),
what a ticket leaves behind (records.py), and `TicketView` (view.py).

May import: services.common, the scheduler's store, events, sandboxes and
executor; never github/ (the GitHub intake drives the engine, not the reverse).
"""
