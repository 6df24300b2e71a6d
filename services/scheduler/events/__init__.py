"""The event log: each ticket's events with a monotonic seq, redacted,
group-committed to the store and delivered to live watchers (log.py); the
writes that keep events across a database outage and name any gap (writes.py).

May import: services.common and the scheduler's store.
"""
