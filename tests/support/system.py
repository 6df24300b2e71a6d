"""The whole back end for tests: the REAL sandbox broker and credential
broker (in-process, see sandbox_broker.py / credential_broker.py) and the
REAL scheduler, either in-process or as a subprocess started like the
launcher does it (link secrets on an inherited fd, readiness on a status fd)
so a test can `kill -9` it and start it again.

    async with afe_system(config_dir, layout) as sys_:
        t = await sys_.stub.CreateTicket(scheduler_pb2.CreateTicketRequest(...))
        async for ev in sys_.stub.WatchTicket(...): ...
        await sys_.kill_scheduler()      # subprocess=True only: SIGKILL
        await sys_.start_scheduler()     # same store, same brokers

`database_url` (an AFE_DATABASE_URL, e.g. the `pg_url` fixture's) puts the
scheduler's store there instead of `<data>/afe.db`, in both modes; a
PostgreSQL one is also where the credential broker checks fences (as under
`afe up`).

`sys_.stub` presents the "automation" link secret; `sys_.gateway_secret` is
the secret a gateway would present (for gateway tests that start their own
gateway against `layout.socket("scheduler")`). `sys_.sandbox` is a sandbox
broker stub (as the scheduler) for inspecting sandboxes; `sys_.instance` is
the broker's unique `afe.instance` label value.
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
from dataclasses import dataclass, field
from pathlib import Path

from services._gen.afe.sandbox.v1 import sandbox_pb2_grpc
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc
from services.common.config.manifests import load_config
from services.common.config.model import Config
from services.common.layout import Layout
from services.common.rpc import grpcutil
from services.common.rpc.links import LinkSecrets, new_secret, pass_via_pipe
from services.common.secrecy.redact import Redactor

from .credential_broker import credential_broker
from .sandbox_broker import sandbox_broker

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class System:
    config_dir: Path
    config: Config
    layout: Layout
    instance: str
    automation_secret: bytes
    gateway_secret: bytes
    sandbox_secret: bytes
    credentials_secret: bytes
    max_running: int = 4
    subprocess_mode: bool = False
    scheduler_env: dict = field(default_factory=dict)
    scheduler_args: list = field(default_factory=list)   # more arguments of the subprocess (--lease-seconds)
    database_url: str = ""
    # the subprocess's module (tests/support/scheduler_on_loop.py: the positive control of issue 32)
    scheduler_module: str = "services.scheduler.main"
    proc: subprocess.Popen | None = None
    app: object | None = None
    channel: object | None = None
    stub: scheduler_pb2_grpc.SchedulerStub | None = None
    sandbox: sandbox_pb2_grpc.SandboxBrokerStub | None = None
    _sandbox_channel: object | None = None
    log_path: Path | None = None
    ready: dict = field(default_factory=dict)   # the subprocess's readiness line (ops_port, socket)

    @property
    def scheduler_links(self) -> LinkSecrets:
        return LinkSecrets(serve={"automation": self.automation_secret, "gateway": self.gateway_secret},
                           call={"sandbox": self.sandbox_secret, "credentials": self.credentials_secret})

    async def start_scheduler(self) -> None:
        if self.subprocess_mode:
            await self._start_subprocess()
        else:
            from services.common.config.database_url import read_database_url
            from services.scheduler.app import SchedulerOptions, build_app
            from services.scheduler.store.url import open_store

            store = None
            if self.database_url:
                store = open_store(read_database_url(self.layout, Redactor(),
                                                     {"AFE_DATABASE_URL": self.database_url}))
            app = build_app(self.config, self.layout, self.scheduler_links, Redactor(),
                            SchedulerOptions(max_running=self.max_running), store=store)
            await app.start()
            self.app = app
        await self._connect()

    async def _connect(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        self.channel = grpcutil.open_channel(str(self.layout.socket("scheduler")), self.automation_secret)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)

    async def _start_subprocess(self) -> None:
        link_fd = pass_via_pipe(self.scheduler_links.to_json())
        status_r, status_w = os.pipe()
        os.set_inheritable(status_w, True)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
               "LANG": "C.UTF-8", "PYTHONPATH": str(REPO_ROOT), **self.scheduler_env}
        if self.database_url:
            env["AFE_DATABASE_URL"] = self.database_url
        self.log_path = self.layout.data_dir.parent / "scheduler.log"
        argv = [sys.executable, "-m", self.scheduler_module, "--config", str(self.config_dir),
                "--data", str(self.layout.data_dir), "--run", str(self.layout.run_dir),
                "--link-fd", str(link_fd), "--status-fd", str(status_w), "--ops-port", "0",
                "--max-running", str(self.max_running), *self.scheduler_args]
        try:
            self.proc = _popen(argv, env, (link_fd, status_w), self.log_path)
        finally:
            os.close(link_fd)
            os.close(status_w)
        loop = asyncio.get_running_loop()
        try:
            line = await asyncio.wait_for(loop.run_in_executor(None, _read_all, status_r), 60)
        finally:
            os.close(status_r)
        if not line:
            raise RuntimeError(f"the scheduler exited before it was ready; see {self.log_path}:\n"
                               + self.log_path.read_text()[-3000:])
        self.ready = json.loads(line)

    async def kill_scheduler(self) -> None:
        """SIGKILL (subprocess mode): no cleanup runs in the scheduler."""
        assert self.proc is not None, "kill_scheduler needs subprocess=True"
        os.kill(self.proc.pid, signal.SIGKILL)
        await asyncio.get_running_loop().run_in_executor(None, self.proc.wait)
        self.proc = None

    async def stop_scheduler(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel = None
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, self.proc.wait), 20)
            except TimeoutError:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.app is not None:
            await self.app.stop(0.5)
            self.app = None


def _popen(argv: list[str], env: dict, fds: tuple[int, ...], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, cwd=str(REPO_ROOT), env=env, pass_fds=fds, stdout=log, stderr=log)


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        b = os.read(fd, 4096)
        if not b:
            break
        chunks.append(b)
    return b"".join(chunks).decode()


@contextlib.asynccontextmanager
async def afe_system(config_dir: str | Path, layout: Layout, *, max_running: int = 4, subprocess: bool = False,
                     scheduler_env: dict | None = None, broker_secrets: dict[str, str] | None = None,
                     agent_env: dict | None = None, start: bool = True,
                     database_url: str = "", scheduler_args: list | None = None,
                     scheduler_module: str = "services.scheduler.main") -> AsyncIterator[System]:
    """Start both brokers and the scheduler for `config_dir`, all on `layout`'s sockets."""
    config_dir = Path(config_dir)
    config = load_config(config_dir)
    layout.ensure()
    async with (
        sandbox_broker(layout, env_values=agent_env,
                       socket_path=str(layout.socket("sandbox"))) as (sb_sock, sb_secret, instance),
        # As `afe up` does: with a PostgreSQL store the broker checks fences in that database (R45).
        credential_broker(config, layout, secrets=broker_secrets, socket_path=layout.socket("credentials"),
                          database_url=database_url) as (_cb_sock, cb_secret),
    ):
        system = System(config_dir=config_dir, config=config, layout=layout, instance=instance,
                        automation_secret=new_secret(), gateway_secret=new_secret(),
                        sandbox_secret=sb_secret, credentials_secret=cb_secret, max_running=max_running,
                        subprocess_mode=subprocess, scheduler_env=dict(scheduler_env or {}),
                        database_url=database_url, scheduler_args=list(scheduler_args or []),
                        scheduler_module=scheduler_module)
        system._sandbox_channel = grpcutil.open_channel(sb_sock, sb_secret)
        system.sandbox = sandbox_pb2_grpc.SandboxBrokerStub(system._sandbox_channel)
        try:
            if start:
                await system.start_scheduler()
            yield system
        finally:
            try:
                await system.stop_scheduler()
            finally:
                await system._sandbox_channel.close()
