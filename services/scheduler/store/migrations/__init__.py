"""Numbered SQL migrations, one folder per store backend.

`sqlite/NNNN_name.sql` and `postgresql/NNNN_name.sql`: file N brings the
schema from version N-1 to N. Released files are never edited; a change is
a new file. Both stores record each applied version, with the afe release
that applied it, in their `schema_version` table, so an older afe that
meets a newer schema can name the release it needs.
"""

from __future__ import annotations

import importlib.metadata
import re
from importlib import resources

_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


def load(backend: str) -> list[str]:
    """The migration scripts of `backend` in order (index i: version i -> i+1),
    comment lines removed."""
    folder = resources.files(__package__).joinpath(backend)
    found: dict[int, str] = {}
    for entry in folder.iterdir():
        m = _NAME.match(entry.name)
        if m:
            text = entry.read_text(encoding="utf-8")
            found[int(m.group(1))] = "\n".join(
                line for line in text.splitlines() if not line.lstrip().startswith("--"))
    if sorted(found) != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migrations/{backend}: files must be numbered 0001, 0002, ... without a gap")
    return [found[n] for n in sorted(found)]


def afe_version() -> str:
    """This afe's release, recorded next to each schema version it applies."""
    try:
        return importlib.metadata.version("afe")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def newer_schema_message(what: str, found: int, known: int, needed: str | None) -> str:
    """What to tell an operator whose database is at a schema this afe does not know."""
    release = f"afe {needed} or later" if needed else "a newer afe"
    return (f"{what} has schema version {found}, newer than this afe ({afe_version()}, schema "
            f"{known}) knows: it was upgraded by {release}. Run {release}, or point AFE_DATABASE_URL at "
            "another database")
