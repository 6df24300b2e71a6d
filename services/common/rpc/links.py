"""Per-link caller secrets.

The launcher makes one random secret per link (gateway->scheduler,
scheduler->sandbox, scheduler->credentials) and hands each process a JSON
document through an inherited file descriptor (never env or argv):

    {"serve": {"<caller>": "<hex>"}, "call": {"<callee>": "<hex>"}}

`serve` lists the callers a process answers; `call` the secrets it presents.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field

METADATA_KEY = "x-afe-link"


@dataclass(frozen=True)
class LinkSecrets:
    serve: dict[str, bytes] = field(default_factory=dict)
    call: dict[str, bytes] = field(default_factory=dict)

    def __repr__(self) -> str:  # never show the secrets
        return f"LinkSecrets(serve={sorted(self.serve)}, call={sorted(self.call)})"

    def to_json(self) -> bytes:
        return json.dumps({
            "serve": {k: v.hex() for k, v in self.serve.items()},
            "call": {k: v.hex() for k, v in self.call.items()},
        }).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LinkSecrets:
        doc = json.loads(data or b"{}")
        return cls(
            serve={k: bytes.fromhex(v) for k, v in doc.get("serve", {}).items()},
            call={k: bytes.fromhex(v) for k, v in doc.get("call", {}).items()},
        )


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def read_link_fd(fd: int) -> LinkSecrets:
    """Read the whole document from an inherited fd and close it."""
    chunks = []
    try:
        while True:
            b = os.read(fd, 65536)
            if not b:
                break
            chunks.append(b)
    finally:
        os.close(fd)
    return LinkSecrets.from_json(b"".join(chunks))


def pass_via_pipe(data: bytes) -> int:
    """Write data into a fresh pipe and return the read end (inheritable).

    The document is small (well below the pipe buffer), so the write never
    blocks; the write end is closed before the child starts.
    """
    r, w = os.pipe()
    try:
        os.write(w, data)
    finally:
        os.close(w)
    os.set_inheritable(r, True)
    return r
