"""The egress side of a sandbox, seen from the host: waiting for the ticket's
squid proxy to listen, and reading the host address of a ticket network's
bridge (R31: there must be none)."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import socket
import struct
import time

import docker

from services.common.errors import Unavailable
from services.sandbox.egress.allowlist import PROXY_PORT

log = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915
STATE_EVERY_S = 0.25


async def wait_proxy(client: docker.DockerClient, proxy_id: str, egress_network: str, ip: str | None = None,
                     timeout: float = 20.0) -> None:
    """Wait until squid accepts connections: probed from the host on the
    proxy's outside network, or from inside the proxy container when the
    host cannot route there."""
    def addr() -> str:
        attrs = client.api.inspect_container(proxy_id)
        nets = attrs["NetworkSettings"]["Networks"]
        address: str = (nets.get(egress_network) or {}).get("IPAddress", "")
        return address

    def inside() -> bool:
        probe = ["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{PROXY_PORT}"]
        e = client.api.exec_create(proxy_id, probe)
        client.api.exec_start(e["Id"])
        code: int = client.api.exec_inspect(e["Id"])["ExitCode"]
        return code == 0

    if ip is None:
        ip = await asyncio.to_thread(addr)
    deadline = time.monotonic() + timeout
    # A refused connection costs nothing: probe often (squid listens some 70-150 ms after
    # its container starts, and a sandbox's first command waits for it); ask the engine
    # whether the proxy still runs only every STATE_EVERY_S.
    delay = 0.01
    state_at = time.monotonic() + STATE_EVERY_S
    while time.monotonic() < deadline:
        if ip:
            try:
                _, w = await asyncio.wait_for(asyncio.open_connection(ip, PROXY_PORT), 1.0)
                w.close()
                return
            except ConnectionRefusedError:
                pass                    # reachable, squid not listening yet
            except (TimeoutError, OSError):
                ip = ""                 # not routable from here: probe from inside
        elif await asyncio.to_thread(inside):
            return
        if not ip or time.monotonic() >= state_at:
            state_at = time.monotonic() + STATE_EVERY_S
            state = await asyncio.to_thread(lambda: client.api.inspect_container(proxy_id)["State"])
            if not state.get("Running"):
                logs = await asyncio.to_thread(client.api.logs, proxy_id, tail=20)
                log.error("egress proxy exited: %s", logs.decode("utf-8", "replace")[-2000:])
                raise Unavailable("the egress proxy failed to start (see the sandbox broker log)")
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 0.05 if ip else 0.25)
    raise Unavailable(f"the egress proxy did not start listening within {timeout:.0f}s")


def bridge_ipv4(name: str) -> str | None:
    """The IPv4 address of the host interface `name`: "" when it has none,
    None when this process cannot see it (the broker runs in a network
    namespace of its own, as under compose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                return ""
            if exc.errno == errno.ENODEV:
                return None
            raise
    return socket.inet_ntoa(res[20:24])
