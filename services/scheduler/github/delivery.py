"""A webhook delivery at the scheduler's edge (docs/GITHUB.md, R35): its body
becomes a document here, once and leniently, and a delivery whose handling
fails is not left recorded as seen.

GitHub signs bytes, not text, and JSON may spell a lone UTF-16 surrogate as
an escape (`"\\ud800"`). `json.loads` turns that into a Python str that no
UTF-8 encoder accepts, so the event used to break much later, inside ticket
creation: the delivery was answered "redeliver later", the redelivery was a
duplicate, and the exception's repr carried the issue's text into the error
log. Decoding here replaces every lone surrogate (and any byte that is not
UTF-8) with U+FFFD, so everything after this point holds text that encodes,
and a signed event is kept rather than lost over one odd character. So is
a NUL (`"\u0000"`, in an issue's title, say): PostgreSQL stores no NUL in a
text column, so such an issue's ticket could not be created there (and on
SQLite it was made, but git refused its title as a commit message: see
executor/nodes/forge_text.py for what else leaves text bound for git).

The delivery id is claimed before anything happens (a replay changes
nothing). When the handling then fails, the gateway answers 503 "redeliver
later"; the claim is released so that the redelivery is handled, never
refused as a duplicate. Such a failure is logged by its type and place
only: an exception's text or repr may quote the payload.
"""

from __future__ import annotations

import json
import logging
import re
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from services.common.errors import AfeError, Internal

from ..store.store import Store

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"
# json.loads pairs a valid surrogate pair into one character; what is left is lone. And NUL, which
# PostgreSQL's text columns refuse.
_UNSTORABLE = re.compile("[\ud800-\udfff\x00]")


def decode_payload(payload: bytes) -> dict[str, Any] | None:
    """The body's JSON object with lone surrogates and NULs replaced, or None when it is
    not a JSON object (or nests deeper than the parser allows)."""
    try:
        text = payload.decode(json.detect_encoding(payload), errors="replace")
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    return _replace_unstorable(doc)


def _clean(value: Any) -> Any:
    return _UNSTORABLE.sub(REPLACEMENT, value) if isinstance(value, str) else value


def _replace_unstorable(doc: dict[str, Any]) -> dict[str, Any]:
    """Every key and string value of `doc`, in place. Iterative: the depth is
    whatever the sender nested, and a recursive walk would fail on it."""
    todo: list[dict[str, Any] | list[Any]] = [doc]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            items = [(_clean(k), _clean(v)) for k, v in node.items()]
            node.clear()
            node.update(items)
            values = [v for _, v in items]
        else:
            node[:] = values = [_clean(v) for v in node]
        todo.extend(v for v in values if isinstance(v, (dict, list)))
    return doc


@contextmanager
def unclaimed_on_failure(store: Store, key: str, delivery_id: str, event: str) -> Iterator[None]:
    """Run the handling of a claimed delivery; if it fails (or is cancelled),
    release the claim and fail with an error that carries no payload text."""
    try:
        yield
    except BaseException as exc:
        store.intake.release_once(key)
        if isinstance(exc, AfeError) or not isinstance(exc, Exception):
            raise
        log.error("github delivery %s (%s) failed: %s at %s; it is not recorded as seen, so a redelivery "
                  "is handled", delivery_id, event, type(exc).__name__, _place(exc))
        raise Internal(f"github delivery {delivery_id} could not be handled; redeliver it later") from None


def _place(exc: BaseException) -> str:
    """Where `exc` was raised (file:line in function): enough to find the bug, no values."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "an unknown place"
    f = frames[-1]
    return f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}"
