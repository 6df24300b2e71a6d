"""The scheduler's durable state behind one interface.

Owns: `Store` and its records (base.py), the SQLite back end (sqlite.py) and
the PostgreSQL one (postgres.py with pg_*.py), the numbered migrations of
both, the retry of statements across a lost or busy database (retry.py), the
store's own thread that runs every statement off the event loop (worker.py),
and opening the store an AFE_DATABASE_URL names (url.py).

May import: services.common and the standard library, database drivers;
nothing else of the scheduler.
"""
