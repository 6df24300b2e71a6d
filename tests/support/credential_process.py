"""The REAL credential broker as a separate process, started like the launcher
starts it (link secrets on an inherited fd, readiness on a status fd), so a
test can `kill -9` it and start it again -- what `afe up` does for a dead
child -- with the same link secret, layout and environment.

    async with system_with_credential_process(config_dir, layout, env) as (sys_, broker):
        ...                              # sys_: tests.support.system.System (scheduler in-process)
        await broker.kill()              # SIGKILL: no cleanup runs in the broker
        await broker.start()             # a new broker process on the same socket

`env` is the broker's environment on top of PATH/HOME/LANG (token variables,
AFE_CA_FILE). The sandbox broker is the real in-process one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from services._gen.afe.sandbox.v1 import sandbox_pb2_grpc
from services.common.config.manifests import load_config
from services.common.layout import Layout
from services.common.rpc import grpcutil
from services.common.rpc.links import LinkSecrets, new_secret, pass_via_pipe

from .sandbox_broker import sandbox_broker
from .system import REPO_ROOT, System, _popen, _read_all


class CredentialProcess:
    def __init__(self, config_dir: Path, layout: Layout, env: dict[str, str] | None = None) -> None:
        self.config_dir = config_dir
        self.layout = layout
        self.env = dict(env or {})
        self.secret = new_secret()           # the scheduler's key; kept across restarts like `afe up` does
        self.proc: subprocess.Popen | None = None
        self.log_path = layout.data_dir.parent / "credentials.log"
        self.starts = 0

    async def start(self) -> None:
        link_fd = pass_via_pipe(LinkSecrets(serve={"scheduler": self.secret}).to_json())
        status_r, status_w = os.pipe()
        os.set_inheritable(status_w, True)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
               "LANG": "C.UTF-8", "PYTHONPATH": str(REPO_ROOT), **self.env}
        argv = [sys.executable, "-m", "services.credentials.main", "--config", str(self.config_dir),
                "--data", str(self.layout.data_dir), "--run", str(self.layout.run_dir),
                "--link-fd", str(link_fd), "--status-fd", str(status_w), "--ops-port", "0"]
        try:
            self.proc = _popen(argv, env, (link_fd, status_w), self.log_path)
        finally:
            os.close(link_fd)
            os.close(status_w)
        try:
            line = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, _read_all, status_r), 60)
        finally:
            os.close(status_r)
        if not line:
            raise RuntimeError(f"the credential broker exited before it was ready:\n{self.log_path.read_text()[-3000:]}")
        json.loads(line)
        self.starts += 1

    async def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        await asyncio.get_running_loop().run_in_executor(None, self.proc.wait)
        self.proc = None

    async def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, self.proc.wait), 20)
        except TimeoutError:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@contextlib.asynccontextmanager
async def system_with_credential_process(config_dir: Path, layout: Layout, env: dict[str, str]
                                         ) -> AsyncIterator[tuple[System, CredentialProcess]]:
    """Sandbox broker (in-process), credential broker (a process), scheduler (in-process)."""
    config = load_config(config_dir)
    layout.ensure()
    broker = CredentialProcess(config_dir, layout, env)
    await broker.start()
    try:
        async with sandbox_broker(layout, socket_path=str(layout.socket("sandbox"))) as (sb_sock, sb_secret, inst):
            system = System(config_dir=config_dir, config=config, layout=layout, instance=inst,
                            automation_secret=new_secret(), gateway_secret=new_secret(),
                            sandbox_secret=sb_secret, credentials_secret=broker.secret)
            system._sandbox_channel = grpcutil.open_channel(sb_sock, sb_secret)
            system.sandbox = sandbox_pb2_grpc.SandboxBrokerStub(system._sandbox_channel)
            try:
                await system.start_scheduler()
                yield system, broker
            finally:
                try:
                    await system.stop_scheduler()
                finally:
                    await system._sandbox_channel.close()
    finally:
        await broker.stop()
