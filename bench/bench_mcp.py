"""MCP relay (R43): an MCP tool call through the relay vs the same call made
straight to the same MCP server. Target: <= 1.1x.

The server is tests/support/mcptracker.py (the official `mcp` SDK over
Streamable HTTP, requiring a bearer token) in a process of its own; its
`get_issue` takes WORK_S, as a tracker's lookup does. The baseline is an
MCP client on the host calling it with the token. The measured path is the
one an agent in a sandbox takes: the client connects to the forwarder
(services/sandbox/relays/forward.py, the same program, on the host's loopback
instead of the sandbox's), which copies the connection to the ticket's
relay socket, where the credential broker's relay (RelayHub, in a process of
its own as in the broker: it shares no interpreter, event loop or caches
with the client) checks the capability and the grant, adds the token,
forwards the call and filters, masks and records the answer. Both clients
are the same aiohttp client over loopback TCP; each keeps its connection
and MCP session (as an agent does); medians of REPEAT calls, alternating
the two paths. A second row is the cold case: a new connection and MCP
session each time (initialize, initialized, then the first tool call;
COLD rounds, alternating), what an agent pays when it starts a session or
its client has let the connection go. A third row reports the warm call
with a server that answers at once: the relay's own cost, with no target.

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
import signal
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
from services.common.config.model import Config, McpServer
from services.common.layout import Layout
from services.common.relayenv import RELAY_MOUNT, RELAY_PORT, RELAY_SOCKET
from services.common.secrecy.env_secrets import SecretValue
from services.common.secrecy.redact import Redactor
from services.credentials.relay.server import RelayHub
from services.sandbox.relays import forward as relayforward

ROOT = Path(__file__).resolve().parents[1]
REPEAT = 40
COLD = 15
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

    async def cold(self) -> float:
        """A new connection and session, to the first tool call's answer."""
        t0 = time.perf_counter()
        await self.start()
        await self.call()
        return time.perf_counter() - t0

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


def _hub_main(root: Path, url: str) -> None:
    """The relay as the credential broker serves it, in this process of its own
    (`python -m bench.bench_mcp hub ROOT URL`): prints the ticket's capability,
    serves until SIGTERM."""
    async def serve() -> None:
        layout = Layout(root / "data", root / "run")
        layout.ensure()
        hub = RelayHub(Config(directory=root, mcp_servers={"tracker": McpServer("tracker", "http", url=url,
                                                                                 token_env="BENCH_TOKEN")}),
                       layout, {"BENCH_TOKEN": SecretValue("BENCH_TOKEN", TOKEN)}, Redactor([TOKEN]),
                       state_dir=root / "state")
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        try:
            print(await hub.open("bench", [], 0, {"tracker": ["get_issue"]}), flush=True)
            await stop.wait()
        finally:
            await hub.aclose()

    asyncio.run(serve())


def _serve_hub(root: Path, url: str) -> tuple[subprocess.Popen, str]:
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}   # R33: no secret inherited
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "bench.bench_mcp", "hub", str(root), url], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    cap = proc.stdout.readline().strip()
    if not cap:
        proc.kill()
        raise RuntimeError("the bench's relay process did not start")
    return proc, cap


def _calls(root: Path) -> list[dict]:
    """The MCP calls the relay recorded (its per-ticket call log)."""
    path = root / "state" / "bench.mcp.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def _measure(root: Path, work_s: float, cold: int) -> tuple[list[float], list[float], list[float], list[float]]:
    """(direct, relayed) warm calls, then (direct, relayed) cold sessions."""
    port = _free_port()
    tracker = _serve_tracker(port, work_s)
    url = f"http://127.0.0.1:{port}/mcp"
    fport = _free_port()
    hub: subprocess.Popen | None = None
    try:
        hub, cap = await asyncio.to_thread(_serve_hub, root, url)
        sock = Layout(root / "data", root / "run").relay_dir("bench") / RELAY_SOCKET
        source = relayforward.SOURCE.replace(repr(f"{RELAY_MOUNT}/{RELAY_SOCKET}"), repr(str(sock)))
        source = source.replace(f"s.bind((\"127.0.0.1\", {RELAY_PORT}))", f"s.bind((\"127.0.0.1\", {fport}))")
        assert str(fport) in source
        await asyncio.to_thread(subprocess.run, [sys.executable, "-c", source], check=True, timeout=30,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})   # R33
        direct_url, relayed_url = url, f"http://127.0.0.1:{fport}/mcp/tracker"
        direct = Client(direct_url, TOKEN)
        relayed = Client(relayed_url, cap)
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
        finally:
            await direct.close()
            await relayed.close()
        dc, rc = [], []
        for _ in range(cold):
            for url_, bearer, out in ((direct_url, TOKEN, dc), (relayed_url, cap, rc)):
                c = Client(url_, bearer)
                try:
                    out.append(await c.cold())
                finally:
                    await c.close()
        for _ in range(200):      # the relay writes a call's line just after its answer
            if len(calls := _calls(root)) >= REPEAT + 5 + cold:
                break
            await asyncio.sleep(0.05)
        assert len(calls) == REPEAT + 5 + cold and all(c["outcome"] == "ok" for c in calls), calls[-3:]
        return d, r, dc, rc
    finally:
        _kill_forwarder(fport)
        if hub is not None:
            hub.terminate()
            hub.wait(10)
        tracker.terminate()
        tracker.wait(10)


def run(out_dir: Path) -> list[Result]:
    out = []
    med = statistics.median

    def notes(extra: str) -> str:
        return ("official mcp SDK server, the relay and the client each in a process of their own; Streamable "
                f"HTTP, bearer token; {extra}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

    for work_s, target in ((WORK_S, 1.1), (0.0, None)):
        with tempfile.TemporaryDirectory(prefix="afe-bench-mcp-", dir="/tmp") as tmp:
            d, r, dc, rc = asyncio.run(_measure(Path(tmp), work_s, COLD if target else 0))
        what = f"the tool takes {work_s * 1000:.0f} ms" if work_s else "the tool answers at once"
        spread = f"relayed p10-p90 {_pct(r, 10) * 1000:.1f}-{_pct(r, 90) * 1000:.1f} ms"
        out.append(Result(
            issue=33, name=f"MCP tool call through the relay ({what})",
            baseline="the same call straight to the same MCP server, with its token", measured_s=med(r),
            baseline_s=med(d), target=target,
            notes=notes(f"kept connection and session; median of {REPEAT}; {spread}")
            + ("" if target else "; the relay's own cost, no target")))
        if dc:
            out.append(Result(
                issue=33, name=f"MCP tool call through the relay, cold ({what})",
                baseline="the same, straight to the same MCP server", measured_s=med(rc), baseline_s=med(dc),
                target=None,
                notes=notes(f"a new connection and MCP session each time (initialize, initialized, first tool "
                            f"call), as an agent starting a session; median of {len(dc)}; the relay's connection "
                            "to the server is kept between sessions (one idle past the server's keep-alive is "
                            "opened again)")))
    return out


def _pct(xs: list[float], p: int) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, len(xs) * p // 100)]


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "hub":
    _hub_main(Path(sys.argv[2]), sys.argv[3])
