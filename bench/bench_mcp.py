"""MCP relay (R43): an MCP tool call through the relay vs the same call made
straight to the same MCP server. Target: <= 1.1x.

The server is tests/support/mcptracker.py (the official `mcp` SDK over
Streamable HTTP, requiring a bearer token) in a process of its own; its
`get_issue` takes WORK_S, as a tracker's lookup does. The baseline is an
MCP client on the host calling it with the token. The measured path is the
one an agent in a sandbox takes: the client connects to the forwarder
(services/sandbox/relayforward.py, the same program, on the host's loopback
instead of the sandbox's), which copies the connection to the ticket's
relay socket, where the credential broker checks the capability and the
grant, adds the token, forwards the call and filters, masks and records the
answer. Both clients keep their connection and MCP session (as an agent
does); medians of REPEAT calls, alternating the two paths. A second row
reports the same with a server that answers at once: the relay's own cost,
with no target.

The relayed call wakes two more processes than the direct one (the
forwarder and the relay's side of the broker) after the server's wait, so
on a machine whose cores are all busy the ratio grows with that machine's
scheduling delay, not with the relay's work: read it with the report's load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.bench_relay import _free_port, _kill_forwarder
from bench.common import Result
from services.common.config import Config, McpServer
from services.common.layout import Layout
from services.common.redact import Redactor
from services.common.relayenv import RELAY_MOUNT, RELAY_PORT, RELAY_SOCKET
from services.common.secrets import SecretValue
from services.credentials.relay import RelayHub
from services.sandbox import relayforward

ROOT = Path(__file__).resolve().parents[1]
REPEAT = 40
WORK_S = 0.02        # a fast tracker's lookup
TOKEN = "bench-mcp-token-" + "t" * 24
INIT = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}}


class Client:
    """An MCP client on one kept connection (its session started)."""

    def __init__(self, url: str, bearer: str) -> None:
        self.url, self.bearer, self.sid, self.n = url, bearer, "", 0
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, force_close=False))

    async def post(self, doc: dict) -> str:
        h = {"Authorization": f"Bearer {self.bearer}", "Accept": "application/json, text/event-stream",
             "Content-Type": "application/json"}
        if self.sid:
            h["Mcp-Session-Id"] = self.sid
        async with self.http.post(self.url, data=json.dumps(doc), headers=h) as r:
            self.sid = r.headers.get("Mcp-Session-Id", self.sid)
            text = await r.text()
            assert r.status in (200, 202), (r.status, text[:300])
            return text

    async def start(self) -> None:
        await self.post(INIT)
        await self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})

    async def call(self) -> float:
        self.n += 1
        t0 = time.perf_counter()
        text = await self.post({"jsonrpc": "2.0", "id": self.n, "method": "tools/call",
                                "params": {"name": "get_issue", "arguments": {"number": self.n}}})
        took = time.perf_counter() - t0
        assert "login page" in text, text[:300]
        return took

    async def close(self) -> None:
        await self.http.close()


def _serve_tracker(port: int, work_s: float) -> subprocess.Popen:
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.mcptracker", str(port), TOKEN, str(work_s)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the bench MCP server did not start")


async def _measure(root: Path, work_s: float) -> tuple[list[float], list[float]]:
    layout = Layout(root / "data", root / "run")
    layout.ensure()
    port = _free_port()
    tracker = _serve_tracker(port, work_s)
    url = f"http://127.0.0.1:{port}/mcp"
    hub = RelayHub(Config(directory=root, mcp_servers={"tracker": McpServer("tracker", "http", url=url,
                                                                             token_env="BENCH_TOKEN")}),
                   layout, {"BENCH_TOKEN": SecretValue("BENCH_TOKEN", TOKEN)}, Redactor([TOKEN]),
                   state_dir=root / "state")
    fport = _free_port()
    try:
        cap = await hub.open("bench", [], 0, {"tracker": ["get_issue"]})
        source = relayforward.SOURCE.replace(repr(f"{RELAY_MOUNT}/{RELAY_SOCKET}"),
                                             repr(str(layout.relay_dir("bench") / RELAY_SOCKET)))
        source = source.replace(f"s.bind((\"127.0.0.1\", {RELAY_PORT}))", f"s.bind((\"127.0.0.1\", {fport}))")
        assert str(fport) in source
        await asyncio.to_thread(subprocess.run, [sys.executable, "-c", source], check=True, timeout=30,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})   # R33
        direct = Client(url, TOKEN)
        relayed = Client(f"http://127.0.0.1:{fport}/mcp/tracker", cap)
        try:
            await direct.start()
            await relayed.start()
            for _ in range(5):      # warm-up
                await direct.call()
                await relayed.call()
            d, r = [], []
            for _ in range(REPEAT):
                d.append(await direct.call())
                r.append(await relayed.call())
            calls, _ = hub.mcp_calls("bench")
            assert len(calls) == REPEAT + 5 and all(c["outcome"] == "ok" for c in calls)
            return d, r
        finally:
            await direct.close()
            await relayed.close()
    finally:
        _kill_forwarder(fport)
        await hub.aclose()
        tracker.terminate()
        tracker.wait(10)


def run(out_dir: Path) -> list[Result]:
    out = []
    med = statistics.median
    for work_s, target in ((WORK_S, 1.1), (0.0, None)):
        with tempfile.TemporaryDirectory(prefix="afe-bench-mcp-", dir="/tmp") as tmp:
            d, r = asyncio.run(_measure(Path(tmp), work_s))
        what = f"the tool takes {work_s * 1000:.0f} ms" if work_s else "the tool answers at once"
        out.append(Result(
            issue=33, name=f"MCP tool call through the relay ({what})",
            baseline="the same call straight to the same MCP server, with its token", measured_s=med(r),
            baseline_s=med(d), target=target,
            notes=f"official mcp SDK server in its own process, Streamable HTTP, bearer token; kept connection and "
                  f"session; median of {REPEAT}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
                  + ("" if target else "; the relay's own cost, no target")))
    return out
