"""The host side of the R31 probe: this host's addresses as seen from a
container, a listener on this host that records which probe packets
arrived, and what a probe got through."""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import shutil
import sys
from typing import Any, Self

from .probescripts import LISTENER


def host_addresses(inside_if: str = "eth0") -> list[str]:
    """Every address of this host on every interface but loopback, as a
    probe target seen from a container: IPv6 link-local ones scoped to the
    container's own interface. From `ip -j addr`, or /proc without iproute2."""
    out: list[str] = []
    if shutil.which("ip"):
        import json
        import subprocess

        from services.common.secrecy.childenv import tool_env
        doc = json.loads(subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True,
                                        check=True, timeout=10, env=tool_env()).stdout)
        addrs = [a["local"] for i in doc for a in i.get("addr_info", []) if "local" in a]
    else:
        addrs = []
        with open("/proc/net/fib_trie") as f:
            lines = f.read().splitlines()
        for prev, line in itertools.pairwise(lines):
            if line.strip() == "/32 host LOCAL":
                addrs.append(prev.split()[-1])
        with contextlib.suppress(FileNotFoundError), open("/proc/net/if_inet6") as f:
            for line in f:
                h = line.split()[0]
                addrs.append(str(ipaddress.IPv6Address(int(h, 16))))
    for addr in addrs:
        ip = ipaddress.ip_address(addr.split("%")[0])
        if ip.is_loopback:
            continue
        target = f"{ip}%{inside_if}" if ip.version == 6 and ip.is_link_local else str(ip)
        if target not in out:
            out.append(target)
    return out


class HostListener:
    """LISTENER in a child process on this host; `lines` collects what it
    received. A context manager: the child is ended on exit."""

    def __init__(self) -> None:
        import subprocess
        import threading

        from services.common.secrecy.childenv import tool_env
        self.proc = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True,
                                     env=tool_env())
        assert self.proc.stdout is not None  # stdout=PIPE
        self._out = self.proc.stdout
        first = self._out.readline().split()
        if first[:1] != ["ready"]:
            self.close()
            raise RuntimeError("the host listener did not start")
        self.port = int(first[1])
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._out:
            with self._changed:
                self.lines.append(line.strip())
                self._changed.notify_all()

    def received(self, token: str) -> list[str]:
        with self._changed:
            return [x for x in self.lines if f" {token} " in f" {x} "]

    def wait_for(self, token: str, count: int, timeout: float = 5.0) -> list[str]:
        """What arrived with `token`, once `count` lines have (or at timeout)."""
        with self._changed:
            self._changed.wait_for(lambda: len([x for x in self.lines if f" {token} " in f" {x} "]) >= count,
                                   timeout)
        return self.received(token)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reached(result: dict[str, Any], listener_lines: list[str]) -> list[str]:
    """What a probe got through: 'tcp A', 'udp A' (the host received it) and
    'icmp A' (an echo reply came back)."""
    got = {f"tcp {a}" for a, r in result.items() if r["tcp"] == "CONNECTED"}
    got |= {f"icmp {a}" for a, r in result.items() if r["icmp"] == "REPLY"}
    for line in listener_lines:            # "<kind> <token> <kind> <address>"
        parts = line.split()
        if len(parts) == 4:
            got.add(f"{parts[2]} {parts[3]}")
    return sorted(got)
