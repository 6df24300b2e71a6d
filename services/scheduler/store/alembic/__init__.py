"""Alembic's migrations of the store (migrate.py runs them; env.py is Alembic's environment)."""
