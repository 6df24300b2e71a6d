"""Egress without a network interface: the sandbox keeps `--network none`
and reaches its ticket's squid proxy through a Unix socket.

Used for every gVisor sandbox (runsc cannot join a network on hosts like
the one afe is tested on) and, when the broker is started with
`--egress-transport socket`, for runc sandboxes too (docs/adr).

    sandbox (no interface)              host folder <run>/egress/<ticket>       proxy container
    HTTP(S)_PROXY=127.0.0.1:3128  ->  forwarder  ->  proxy.sock  ->  forwarder -> squid on 127.0.0.1:3128
                                  (relays/forward.py)                 (PROXY_MAIN)          -> the outside network

The proxy's rules, its access log (the denial report, R11) and its outside
network are the ones of the network transport; only the way in changes.
Squid listens on the proxy container's own loopback, so nothing on its
outside network can use it; the socket is the only way in, and only the
ticket's sandbox has its folder mounted (read-only: connecting to a socket
needs no write access to the mount).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from services.common import safefs
from services.common.errors import Unavailable
from services.common.layout import Layout, check_ticket_id
from services.sandbox.egress.allowlist import PROXY_PORT, proxy_env
from services.sandbox.relays import forward as relayforward

EGRESS_MOUNT = "/run/afe-egress"     # the ticket's egress folder, in the sandbox (read-only) and the proxy
EGRESS_SOCKET = "proxy.sock"
EGRESS_PORT = 3128                   # the sandbox's forwarder, on its own 127.0.0.1
PROXY_UID = 13                       # the proxy image's `proxy` user (Debian's), who makes the socket
TRANSPORTS = ("network", "socket")

# The proxy container's main process: squid as its child, listening on the
# container's loopback; the socket is bound once squid answers there (so a
# socket that accepts means a proxy that works), and one thread relays every
# connection to it to squid (socket_relay.py), at most MAX_CONNECTIONS at once
# (more are closed as they come and counted in the container's log once a
# minute). It ends when squid ends, with squid's exit code.
# Its arguments: the socket's path, squid's port, MAX_CONNECTIONS.
PROXY_MAIN = relayforward.RELAY_SOURCE + """
import subprocess


def proxy_main(sock_path, port, max_connections):
    with open("/tmp/squid.conf", "w") as f:
        f.write(os.environ["AFE_SQUID_CONF"])
    squid = subprocess.Popen(["squid", "-N", "-f", "/tmp/squid.conf"])
    for _ in range(400):
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            break
        except OSError:
            if squid.poll() is not None:
                sys.exit(squid.returncode or 1)
            time.sleep(0.05)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock_path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sock_path)
    os.chmod(sock_path, 0o666)
    s.listen(128)
    relay = Relay(s, ("127.0.0.1", port), max_connections,
                  say=lambda m: print("afe egress relay: " + m, file=sys.stderr, flush=True))

    def tick():
        if squid.poll() is not None:
            relay.stop()

    relay.run(tick)
    sys.exit(squid.wait())


proxy_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
"""
MAX_CONNECTIONS = 256

SANDBOX_FORWARDER = relayforward.source(EGRESS_PORT, f"{EGRESS_MOUNT}/{EGRESS_SOCKET}")


def egress_dir(layout: Layout, ticket_id: str) -> Path:
    return layout.run_dir / "egress" / check_ticket_id(ticket_id)


def make_egress_dir(layout: Layout, ticket_id: str) -> str:
    """The ticket's egress folder, owned by the proxy's user (who makes the
    socket in it), searchable by the sandbox's user."""
    d = egress_dir(layout, ticket_id)
    d.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    with contextlib.suppress(FileExistsError):
        d.mkdir(mode=0o755)
    if os.geteuid() == 0:
        os.chown(d, PROXY_UID, PROXY_UID)
    os.chmod(d, 0o755)
    return str(d)


def remove_egress_dir(layout: Layout, ticket_id: str) -> None:
    safefs.remove_tree(egress_dir(layout, ticket_id))


def reconcile(layout: Layout, live: set[str]) -> set[str]:
    """Remove the egress folders of tickets that are not live; returns their ids."""
    return safefs.remove_dirs_except(layout.run_dir / "egress", live)


def sandbox_proxy_env() -> dict[str, str]:
    return proxy_env("127.0.0.1", EGRESS_PORT)


def proxy_command(max_connections: int = MAX_CONNECTIONS) -> list[str]:
    return ["python3", "-c", PROXY_MAIN, f"{EGRESS_MOUNT}/{EGRESS_SOCKET}", str(PROXY_PORT), str(max_connections)]


def _accepts(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


async def wait_socket(layout: Layout, ticket_id: str, proxy_running: Callable[[], bool],
                      timeout: float = 20.0) -> None:
    """Wait until the proxy's socket accepts (its squid answers by then);
    `proxy_running()` (blocking) says whether the proxy container still runs."""
    path = str(egress_dir(layout, ticket_id) / EGRESS_SOCKET)
    deadline = time.monotonic() + timeout
    delay = 0.02
    while time.monotonic() < deadline:
        if await asyncio.to_thread(_accepts, path):
            return
        if not await asyncio.to_thread(proxy_running):
            raise Unavailable("the egress proxy failed to start (see the sandbox broker log)")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.25)
    raise Unavailable(f"the egress proxy's socket did not accept connections within {timeout:.0f}s")
