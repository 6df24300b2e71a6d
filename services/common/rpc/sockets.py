"""The local Unix sockets afe's gRPC servers listen on and its channels
connect to: the address, the file mode, the message size limit."""

from __future__ import annotations

import os

from services.common import errors


def socket_target(path: str) -> str:
    return "unix://" + os.path.abspath(path)


MAX_MESSAGE = 32 * 1024 * 1024
OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]


def socket_mode() -> int:
    """0600 (same user only) unless AFE_SOCKET_MODE=0660: the deployment in
    deploy/systemd and deploy/compose runs each process as its own user and
    lets exactly one caller group connect (the process's primary group)."""
    value = os.environ.get("AFE_SOCKET_MODE", "0600").strip()
    if value not in ("0600", "0660"):
        raise errors.ConfigError("AFE_SOCKET_MODE must be 0600 or 0660")
    return int(value, 8)
