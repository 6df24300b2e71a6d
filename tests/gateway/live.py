"""The running system for gateway/CLI end-to-end tests: the real brokers and
scheduler (tests/support/system.py, demo config) plus the real gateway
process, shared by the tests of one folder in a row (tests/gateway,
tests/cli: `live_afe` is package-scoped).

The system lives in its own event loop and thread so async and sync tests
(Playwright, CLI subprocesses) can all use it; it is reference-counted so
tests/gateway and tests/cli share one instance. It is stopped when the
worker leaves those folders: its gRPC channels live on that thread's loop,
and grpc.aio used from two threads' loops at once (this one and another
area's tests on the main thread, in the same worker of a parallel run)
crashed workers with a segmentation fault.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from services.common import demo
from services.common.layout import Layout
from services.common.secrecy.tokenfile import write_token_file

from .conftest import GatewayProc, start_gateway


@dataclass
class Live:
    root: Path
    layout: Layout
    config_dir: Path
    gateway: GatewayProc
    bare_repo: Path
    initial_main: str

    def reset_demo_repo(self) -> None:
        """Put the demo repository's main back on its first commit (the bug
        present), so every test that runs the demo sees the same change."""
        subprocess.run(["git", "--git-dir", str(self.bare_repo), "update-ref", "refs/heads/main",
                        self.initial_main], check=True, capture_output=True)


class _Holder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.refs = 0
        self.live: Live | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.cm = None

    def _run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def acquire(self) -> Live:
        with self.lock:
            if self.live is None:
                self._start()
            self.refs += 1
            return self.live

    def release(self) -> None:
        with self.lock:
            self.refs -= 1
            if self.refs == 0 and self.live is not None:
                self._stop()

    def _start(self) -> None:
        from tests.support.system import afe_system

        root = Path(tempfile.mkdtemp(prefix="afe-live-", dir="/tmp"))
        cfg = demo.materialize(root / "cfg")
        layout = Layout(root / "data", root / "run")
        layout.ensure()
        write_token_file(layout.token_file)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="afe-live")
        self.thread.start()
        self.cm = afe_system(cfg, layout)
        system = self._run(self.cm.__aenter__())
        try:
            gw = start_gateway(layout, system.gateway_secret, config_dir=cfg)
        except Exception:
            self._run(self.cm.__aexit__(None, None, None))
            raise
        bare = cfg / "repos" / "calc.git"
        head = subprocess.run(["git", "--git-dir", str(bare), "rev-parse", "refs/heads/main"], check=True,
                              capture_output=True, text=True).stdout.strip()
        self.live = Live(root, layout, cfg, gw, bare, head)

    def _stop(self) -> None:
        live, self.live = self.live, None
        try:
            live.gateway.stop()
        finally:
            try:
                self._run(self.cm.__aexit__(None, None, None))
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(10)
                shutil.rmtree(live.root, ignore_errors=True)


HOLDER = _Holder()
