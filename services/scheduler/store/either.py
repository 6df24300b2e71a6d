"""One SQL statement for either back end, for the record mixins of `Store`
(ci_records.py, run_records.py, verification_records.py) whose SQL is the
same on SQLite and PostgreSQL but for the placeholder."""

from __future__ import annotations

import sqlite3
from typing import Any


class EitherBackend:
    db: Any

    def _sql(self, sql: str, args: tuple) -> Any:
        """Run `sql` (with `%s` placeholders) on this store's connection: SQLite's, or the
        PostgreSQL store's live one; returns its cursor."""
        if isinstance(self.db, sqlite3.Connection):
            return self.db.execute(sql.replace("%s", "?"), args)
        return self._conn().execute(sql, args)      # type: ignore[attr-defined]  # PostgresStore's live one
