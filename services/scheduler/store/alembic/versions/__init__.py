"""The store's revisions, in order (Alembic reads them; never imported by afe itself)."""
