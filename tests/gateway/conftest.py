"""Gateway fixtures: the real gateway process, against a real gRPC server of
the Scheduler contract (a small fake, run in its own thread), with its logs
captured to a file so tests can check that no secret reached them."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common.layout import Layout
from services.common.rpc.links import LinkSecrets, new_secret, pass_via_pipe
from services.common.secrecy.tokenfile import write_token_file

from .fake_scheduler import FakeScheduler, start_fake_scheduler

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class GatewayProc:
    proc: subprocess.Popen
    url: str
    port: int
    log_path: Path
    token_file: Path
    ops_port: int

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    @property
    def origin(self) -> str:
        return self.url

    @property
    def ws_url(self) -> str:
        return self.url.replace("http", "ws", 1) + "/rpc"

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_gateway(layout: Layout, secret: bytes | None, *, token_file: Path | None = None,
                  public_url: str | None = None, extra: list[str] | None = None,
                  env: dict[str, str] | None = None, config_dir: Path | None = None,
                  module: str = "gateway.main", port: int = 0) -> GatewayProc:
    """Start `python -m gateway.main` as the launcher would; wait for its ready line. `module`
    names a stand-in that runs the gateway with an old code path (positive controls). `port`:
    0 (the default) lets the gateway bind a free port and say which in its ready line, so
    parallel test workers never race for one; a test that restarts a gateway passes its port."""
    token_file = token_file or layout.token_file
    links = LinkSecrets(call={"scheduler": secret} if secret else {})
    link_fd = pass_via_pipe(links.to_json())
    status_r, status_w = os.pipe()
    log_path = layout.data_dir.parent / f"gateway-{secrets.token_hex(4)}.log"
    argv = [sys.executable, "-m", module, "--config", str(config_dir or layout.data_dir),
            "--data", str(layout.data_dir), "--run", str(layout.run_dir),
            "--link-fd", str(link_fd), "--status-fd", str(status_w), "--ops-port", "0",
            "--listen", f"127.0.0.1:{port}", "--token-file", str(token_file), "--log-level", "DEBUG",
            *(["--public-url", public_url] if public_url else []), *(extra or [])]
    full_env = {k: v for k, v in os.environ.items() if k != "AFE_UI_TOKEN"}
    full_env.update(env or {})
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(argv, cwd=ROOT, pass_fds=(link_fd, status_w), stdout=logf, stderr=logf,
                                env=full_env)
    os.close(link_fd)
    os.close(status_w)
    try:
        ready, _, _ = select.select([status_r], [], [], 30)
        line = os.read(status_r, 65536) if ready else b""
    finally:
        os.close(status_r)
    if not line:
        proc.kill()
        raise RuntimeError("gateway did not become ready:\n" + log_path.read_text(errors="replace"))
    info = json.loads(line)
    return GatewayProc(proc, f"http://127.0.0.1:{info['port']}", info["port"], log_path, token_file,
                       info["ops_port"])


class FakeSchedulerThread:
    """The fake scheduler in its own event loop and thread."""

    def __init__(self, socket_path: Path, secret: bytes) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.fake: FakeScheduler
        self.fake, self.server = self.call(start_fake_scheduler(str(socket_path), secret))

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def run(self, fn, *args):
        async def _do():
            return fn(*args)
        return self.call(_do())

    def stop(self) -> None:
        self.call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def gw_layout():
    d = Path(tempfile.mkdtemp(prefix="afe-gw-", dir="/tmp"))
    lay = Layout(d / "data", d / "run")
    lay.ensure()
    write_token_file(lay.token_file)
    yield lay
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def link_secret() -> bytes:
    return new_secret()


@pytest.fixture(scope="module")
def scheduler(gw_layout, link_secret):
    s = FakeSchedulerThread(gw_layout.socket("scheduler"), link_secret)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gateway(gw_layout, link_secret, scheduler):
    g = start_gateway(gw_layout, link_secret, extra=["--max-failed-logins", "1000"])
    yield g
    g.stop()


@pytest.fixture
async def http():
    """A client that never stores cookies: every test says exactly what it sends."""
    import aiohttp

    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as s:
        yield s


@pytest.fixture(scope="package")
def live_afe():
    """The real system (brokers, scheduler, gateway) with the demo config."""
    from .live import HOLDER

    live = HOLDER.acquire()
    yield live
    HOLDER.release()
