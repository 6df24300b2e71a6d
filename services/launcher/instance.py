"""The `afe.instance` of an `afe up`: its data folder's own unless `--instance` names one.

A sandbox broker treats every Docker object with its `afe.instance` label as
its own: when it starts it removes those of tickets its scheduler does not
know (R12 reconcile), and a stopped `afe up` lists them as kept for its
tickets. With one fixed default, every `afe up` on a Docker engine shared a
label — the demo in afe's checkout and then `afe up` in your repository, or
two repositories side by side — so the second one's start removed the first
one's sandboxes (of a ticket waiting for approval, or running) and its stop
listed them as its own, with advice (`afe ticket cancel ID`) it could not
follow.

So a data folder gets its own id on its first start, kept in
`<data>/instance`: the folder's project name and a random suffix
(`myproject-3fa9c1`), so `docker ps` tells them apart. A data folder afe
used before this file existed keeps `default`, the label its sandboxes
already carry (they are resumed, not orphaned). `--instance ID` wins for the
run it is given to, and is what a new data folder keeps.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from services.common.errors import ConfigError
from services.common.layout import STATE_FOLDER, Layout

LEGACY = "default"       # the label of every `afe up` before ids were per data folder
FILE = "instance"


def instance_file(layout: Layout) -> Path:
    return layout.data_dir / FILE


def _used_before(layout: Layout) -> bool:
    """Whether an earlier `afe up` ran on this data folder (its store, UI token or workspaces)."""
    return any(p.exists() for p in (layout.store_file, layout.token_file, layout.workspaces_dir))


def new_id(layout: Layout) -> str:
    """`<project>-<6 hex>`: the folder `.afe/` sits in (else the data folder's own name), made a label."""
    folder = layout.data_dir.parent
    source = folder.parent.name if folder.name == STATE_FOLDER else layout.data_dir.name
    stem = re.sub(r"[^a-z0-9]+", "-", source.lower()).strip("-")[:24].strip("-") or "afe"
    return f"{stem}-{secrets.token_hex(3)}"


def resolve(layout: Layout, given: str | None) -> str:
    """The instance this `afe up` runs as; writes `<data>/instance` when the folder has none.

    Call before the data folder is first used (its store and token are what
    tells an older data folder apart). Raises ConfigError for a file that
    does not hold an id."""
    from services.common.layout import INSTANCE_RE

    path = instance_file(layout)
    try:
        kept = path.read_text().strip()
    except FileNotFoundError:
        kept = None
    if kept is not None and not INSTANCE_RE.match(kept):
        raise ConfigError(f"{path} does not hold an instance id (1-40 characters of a-z, 0-9, '_', '.', '-'); "
                          "write the id this data folder's sandboxes carry (`docker ps --format "
                          "'{{.Label \"afe.instance\"}}'`), or remove the file when none is left")
    if given:
        chosen = given
    elif kept:
        return kept
    else:
        chosen = LEGACY if _used_before(layout) else new_id(layout)
    if kept is None:
        layout.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(FILE + ".tmp")
        tmp.write_text(chosen + "\n")
        os.replace(tmp, path)
    return chosen
