"""Model relay (R32): a streamed model request through the relay vs straight
to the same local model server. Targets: time to first byte <= 1.2x, total
<= 1.1x.

The model server is tests/support/fakes/streaming.py (Anthropic Messages,
SSE) thinking like a model: FIRST_S before the first event, then PIECES
events PIECE_S apart. The baseline is an HTTP client on the host calling it
directly. The measured path is the one an agent in a sandbox takes: the
client connects to the forwarder (services/sandbox/relays/forward.py, the same
program, run here on the host's loopback instead of the sandbox's), which
copies the connection to the ticket's relay socket, where the credential
broker's relay checks the capability, swaps in the key, and streams the
answer back. Both paths use fresh connections per request, as an agent's
first call does. Medians of REPEAT requests, alternating the two paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Result
from services.common.config.model import Config, Model
from services.common.layout import Layout
from services.common.relayenv import RELAY_MOUNT, RELAY_PORT, RELAY_SOCKET
from services.common.secrecy.env_secrets import SecretValue
from services.common.secrecy.redact import Redactor
from services.credentials.relay.server import RelayHub
from services.sandbox.relays import forward as relayforward
from tests.support.fakes.streaming import FakeModelAPI

REPEAT = 30
PIECES = 40
FIRST_S = 0.15      # a fast model's time to first token
PIECE_S = 0.01      # 100 tokens/s
KEY = "sk-bench-" + "k" * 32
BODY = b'{"model":"m","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"hi"}]}'


async def _request(port: int, path: str, headers: dict[str, str]) -> tuple[float, float]:
    """(time to the first body byte, total) of one streamed request on a new connection."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(BODY)}\r\nConnection: close\r\n{head}\r\n".encode() + BODY)
    await writer.drain()
    status = await reader.readuntil(b"\r\n\r\n")
    assert b" 200 " in status.split(b"\r\n", 1)[0], status[:200]
    first = await reader.read(1)
    ttfb = time.perf_counter() - t0
    data = first + await reader.read()
    total = time.perf_counter() - t0
    writer.close()
    assert b"message_stop" in data, data[-300:]
    return ttfb, total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _measure(root: Path) -> tuple[list[float], list[float], list[float], list[float]]:
    layout = Layout(root / "data", root / "run")
    layout.ensure()
    async with FakeModelAPI(KEY, pieces=PIECES, first_delay_s=FIRST_S, piece_delay_s=PIECE_S) as upstream:
        model = Model("claude", "anthropic", model="m", base_url=upstream.url, api_key_env="BENCH_KEY")
        hub = RelayHub(Config(directory=root, models={"claude": model}), layout,
                       {"BENCH_KEY": SecretValue("BENCH_KEY", KEY)}, Redactor([KEY]), state_dir=root / "state")
        cap = await hub.open("bench", ["claude"], 0)
        # The forwarder program as the sandbox runs it, pointed at this ticket's socket and a free port.
        port = _free_port()
        source = relayforward.SOURCE.replace(repr(f"{RELAY_MOUNT}/{RELAY_SOCKET}"),
                                             repr(str(layout.relay_dir("bench") / RELAY_SOCKET)))
        source = source.replace(f"s.bind((\"127.0.0.1\", {RELAY_PORT}))", f"s.bind((\"127.0.0.1\", {port}))")
        assert str(port) in source and str(layout.relay_dir("bench")) in source
        await asyncio.to_thread(subprocess.run, [sys.executable, "-c", source], check=True, timeout=30,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})   # R33
        try:
            direct_h = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
            relay_h = {"x-api-key": cap, "anthropic-version": "2023-06-01"}
            for _ in range(3):   # warm-up: imports, first connections
                await _request(upstream.port, "/v1/messages", direct_h)
                await _request(port, "/m/claude/v1/messages", relay_h)
            d_ttfb, d_total, r_ttfb, r_total = [], [], [], []
            for _ in range(REPEAT):
                a, b = await _request(upstream.port, "/v1/messages", direct_h)
                d_ttfb.append(a)
                d_total.append(b)
                a, b = await _request(port, "/m/claude/v1/messages", relay_h)
                r_ttfb.append(a)
                r_total.append(b)
            return d_ttfb, d_total, r_ttfb, r_total
        finally:
            _kill_forwarder(port)
            await hub.aclose()


def _kill_forwarder(port: int) -> None:
    """The forwarder detached itself: find it by its listening socket and stop it."""
    inode = None
    with contextlib.suppress(OSError), open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if parts[1].endswith(f":{port:04X}") and parts[3] == "0A":
                inode = parts[9]
    if inode is None:
        return
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    os.kill(int(pid), 9)
                    return


def run(out_dir: Path) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="afe-bench-relay-", dir="/tmp") as tmp:
        d_ttfb, d_total, r_ttfb, r_total = asyncio.run(_measure(Path(tmp)))
    med = statistics.median
    shape = (f"{PIECES} SSE events, first after {FIRST_S * 1000:.0f} ms, then every {PIECE_S * 1000:.0f} ms; "
             f"median of {REPEAT}, new connection per request")
    return [
        Result(issue=12, name="streamed model request through the relay: time to first byte",
               baseline="straight to the same local model server", measured_s=med(r_ttfb),
               baseline_s=med(d_ttfb), target=1.2, notes=shape),
        Result(issue=12, name="streamed model request through the relay: total",
               baseline="straight to the same local model server", measured_s=med(r_total),
               baseline_s=med(d_total), target=1.1, notes=shape),
    ]
