"""Alembic's environment for the store's migrations, run by migrate.py on the
connection (and in the transaction) it opened; there is no alembic.ini and
no offline mode."""

from __future__ import annotations

from alembic import context

from services.scheduler.store.schema import metadata

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",   # SQLite alters a table by copying it
    transactional_ddl=True,
)
with context.begin_transaction():
    context.run_migrations()
