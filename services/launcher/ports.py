"""Pre-flight of `afe up`: every TCP port it is about to listen on is free.

Checked before anything starts (no image build, no process), so a port
another program holds ends in one message naming the port, what it is for,
the process holding it when this user may see it (its pid and name, never
its command line), and the flag that moves it, instead of a child's
traceback and "exited before it was ready".
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import ConfigError

LISTEN_STATE = "0A"     # TCP_LISTEN in /proc/net/tcp{,6}


@dataclass(frozen=True)
class PortUse:
    host: str
    port: int
    what: str       # what listens there, for people
    fix: str        # the flag (and value) that moves it

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def split_host_port(value: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) as `--listen` takes it."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--listen must be HOST:PORT (e.g. 127.0.0.1:8420), not {value!r}")
    return host.strip("[]"), int(port)


def planned(listen: str, ops_host: str, ops_ports: dict[str, int]) -> list[PortUse]:
    """The ports `afe up` will listen on (port 0, a free one picked at start, is never taken)."""
    host, port = split_host_port(listen)
    uses = []
    if port:
        other = f"{host}:{port + 1}" if ":" not in host else f"[{host}]:{port + 1}"
        uses.append(PortUse(host, port, "the web UI and /rpc",
                            f"--listen {other} (and AFE_URL=http://{other} for the CLI)"))
    for service, p in ops_ports.items():
        if p:
            uses.append(PortUse(ops_host, p, f"the {service} process's /livez, /readyz and /metrics",
                                f"--ops-port {service}=PORT, or --ops-port 0 for free ports"))
    return uses


def _free(host: str, port: int) -> bool:
    """Whether a server could bind host:port now, as afe's servers bind (SO_REUSEADDR)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return True      # an unknown name fails later with its own message, not as a taken port
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return True


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in (Path("/proc/net") / name).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) <= 9 or fields[3] != LISTEN_STATE:
                    continue
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    return inodes


def holder(port: int) -> str | None:
    """'pid N (name)' of a process listening on `port`, when this user may see it; else None."""
    wanted = {f"socket:[{i}]" for i in _listening_inodes(port)}
    if not wanted:
        return None
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                if os.readlink(fd.path) in wanted:
                    name = Path(f"/proc/{entry.name}/comm").read_text().strip()
                    return f"pid {entry.name} ({name})"
        except OSError:      # not ours to look into, or gone meanwhile
            continue
    return None


def check_ports(uses: list[PortUse]) -> None:
    """Raise ConfigError naming every planned port that is taken, and how to move it."""
    taken = []
    seen: dict[tuple[str, int], PortUse] = {}
    for use in uses:
        first = seen.setdefault((use.host, use.port), use)
        if first is not use:
            taken.append(f"  {use.address} ({use.what}): also asked for {first.what}; pass {use.fix}")
            continue
        if _free(use.host, use.port):
            continue
        who = holder(use.port)
        by = f"held by {who}" if who else "held by another program (one this user may not look into)"
        taken.append(f"  {use.address} ({use.what}): {by}; stop it, or pass {use.fix}")
    if taken:
        raise ConfigError("these ports are already in use, so afe started nothing:\n" + "\n".join(taken))
