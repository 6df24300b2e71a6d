"""Reading listening TCP sockets from /proc/net/tcp{,6} (no tools needed)."""

from __future__ import annotations

import ipaddress
import socket
import struct
from pathlib import Path

LISTEN = "0A"


def _addr4(hex_ip: str) -> str:
    return socket.inet_ntoa(struct.pack("<I", int(hex_ip, 16)))


def _addr6(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listeners(port: int) -> set[str]:
    """Local addresses listening on `port` (IPv4 and IPv6) on this machine."""
    found: set[str] = set()
    for name, conv in (("tcp", _addr4), ("tcp6", _addr6)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            hex_ip, hex_port = local.split(":")
            if state == LISTEN and int(hex_port, 16) == port:
                found.add(conv(hex_ip))
    return found
