"""builtin:commit refuses compiled files a reviewer cannot read (issue 31).

A change that adds or modifies a file a runtime loads in place of source
(`services.common.provenance.bytecode`: `__pycache__/`, `*.pyc`, `*.so`, `*.class`,
`*.node`, `*.wasm`, ...) is not committed unless the Workspace's
`allowCompiledPaths` covers it: a committed `__pycache__/calc.cpython-311.pyc`
is what Python imports instead of `calc.py`, and the pull request's diff shows
only "Binary files differ". Deleting such a file is always allowed.

The check reads the tree afe is about to commit (after the workspace's
`.gitignore` files were applied, capture.py): a repository that ignores
`__pycache__/` never gets here with its caches, but the refusal does not rely
on it, since the sandbox may rewrite `.gitignore` too.
"""

from __future__ import annotations

from services.common.config.model import Workspace
from services.common.errors import FailedPrecondition
from services.common.provenance.bytecode import allowed_by, loaded_in_place_of_source

SHOWN = 20          # paths named in the error


class CompiledFilesRefused(FailedPrecondition):
    """The change adds or modifies compiled files outside the Workspace's allowCompiledPaths."""


def changed_paths(name_status: bytes) -> list[tuple[str, bytes]]:
    """(status letter, path) of each entry of `git diff-tree -r -z --name-status --no-renames`."""
    items = name_status.split(b"\0")
    out = []
    for i in range(0, len(items) - 1, 2):
        status = items[i].decode("ascii", "replace")[:1]
        if status:
            out.append((status, items[i + 1]))
    return out


def refused(ws: Workspace, changes: list[tuple[str, bytes]]) -> list[bytes]:
    """The added or modified paths (not deletions) a runtime loads in place of source and
    the Workspace does not allow."""
    out = []
    for status, raw in changes:
        if status == "D":
            continue
        path = raw.decode("utf-8", "surrogateescape")
        if loaded_in_place_of_source(path) and not allowed_by(path, ws.allow_compiled_paths):
            out.append(raw)
    return out


def _show(raw: bytes) -> str:
    """A sandbox-made path for an error: printable, in backticks, bounded."""
    text = raw.decode("utf-8", "backslashreplace")
    text = "".join(c if c.isprintable() and c != "`" else f"\\x{ord(c):02x}" for c in text)
    return "`" + (text if len(text) <= 200 else text[:200] + "...") + "`"


def check(ws: Workspace, ticket_id: str, changes: list[tuple[str, bytes]]) -> None:
    """Raise CompiledFilesRefused, naming the files and what to do, when the change has any."""
    bad = refused(ws, changes)
    if not bad:
        return
    shown = ", ".join(_show(p) for p in bad[:SHOWN]) + (f" and {len(bad) - SHOWN} more" if len(bad) > SHOWN else "")
    first = _show(bad[0])[1:-1]
    folder = first.rsplit("/", 1)[0] + "/" if "/" in first else first
    source = f" ({ws.source})" if ws.source else ""
    raise CompiledFilesRefused(
        f"ticket {ticket_id}: not committed: the change adds or modifies {len(bad)} compiled "
        f"file{'s' if len(bad) != 1 else ''} that a runtime loads in place of source, which a reviewer cannot "
        f"read: {shown}. Remove them from the workspace (for Python caches: set PYTHONDONTWRITEBYTECODE=1 in "
        f"the image, or add __pycache__/ to the repository's .gitignore), or, if the repository really ships "
        f"them, allow their paths in Workspace {ws.name!r}{source}, e.g. allowCompiledPaths: [{folder}]")
