"""The scheduler's durable state: one repository per aggregate over one
database, each statement written once for SQLite and PostgreSQL (SQLAlchemy
Core).

Owns: every table (schema.py); the database, its one connection and its
clock (database.py); the repositories of tickets and node runs (tickets.py),
events (events.py), leases and fences (leases.py) and the records (repos/),
composed in `Store` (store.py); their records (base.py and the record
modules beside it); the Alembic migrations run when the store opens (migrate.py,
alembic/); the retry of statements across a lost or busy database
(retry.py); the store's own thread that runs every statement off the event
loop (worker.py); opening the store an AFE_DATABASE_URL names (url.py).

May import: services.common and the standard library, SQLAlchemy, Alembic
and the database drivers; nothing else of the scheduler.
"""
