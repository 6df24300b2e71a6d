"""Builds the scheduler from its parts (store, broker clients, engine,
servicer, server). Used by main.py and by in-process tests; the one place
that wires them together.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

from services.common.config.model import Config
from services.common.layout import Layout
from services.common.rpc import callers, grpcutil
from services.common.rpc.links import LinkSecrets
from services.common.secrecy.redact import Redactor

from .automation_key import AutomationKeyFile
from .engine.core import LEASE_S, Engine
from .engine.followups import SETTLE_S
from .github.hooks import register as register_hooks
from .github.intake import GitHubIntake
from .github.poll import Poller
from .github.report import GitHubReporter
from .sandboxes.brokers import CredentialsClient, SandboxClient
from .sandboxes.placement import BrokerSet
from .sandboxes.pool import DEFAULT_CAP as DEFAULT_POOL_CAP
from .sandboxes.remoteworkspace import RemoteWorkspaces
from .servicer import WATCH_SEND_TIMEOUT_S, SchedulerServicer, register
from .store.store import Store
from .store.worker import threaded


@dataclass
class SchedulerApp:
    engine: Engine
    store: Store
    sandbox: SandboxClient | BrokerSet
    credentials: CredentialsClient
    server: grpcutil.AfeServer
    automation_key: AutomationKeyFile | None = None
    intake: GitHubIntake | None = None
    poller: Poller | None = None
    reporter: GitHubReporter | None = None

    async def start(self) -> None:
        if self.automation_key is not None:
            self.automation_key.load()      # a key rotated before a restart stays rotated
            self.automation_key.start()
        await self.server.start()
        await self.engine.start()
        if self.intake is not None:
            self.intake.start()
        if self.poller is not None:
            self.poller.start()
        if self.reporter is not None:
            self.reporter.resume()

    async def stop(self, grace: float = 2.0) -> None:
        if self.automation_key is not None:
            await self.automation_key.stop()
        if self.poller is not None:
            await self.poller.stop()
        if self.intake is not None:
            await self.intake.stop()
        if self.reporter is not None:
            await self.reporter.stop()
        await self.server.stop(grace)
        await self.engine.stop()
        await self.sandbox.close()
        await self.credentials.close()
        self.store.close()


@dataclass(frozen=True)
class SchedulerOptions:
    """How one scheduler is set up (the flags of `services/scheduler/main.py`);
    every default is the scheduler's default."""

    store_path: Path | None = None        # the SQLite store; None: `<data>/afe.db` (unless a store is given)
    max_running: int = 4                  # tickets run at once
    # s between checks for a restarted sandbox broker and retries of failed teardowns (0: never, tests)
    recovery_interval: float = 2.0
    watch_send_timeout: float = WATCH_SEND_TIMEOUT_S   # a watch whose caller takes nothing this long is dropped
    pool_cap: int = DEFAULT_POOL_CAP      # warm sandboxes kept ready in all workspaces (sandboxes/pool.py)
    public_url: str = ""                  # the UI's address, for the ticket links afe writes on GitHub
    # This scheduler's id and its tickets' lease on a shared store (docs/SCALE.md); "": a new id.
    owner: str = ""
    lease_s: float = LEASE_S
    github_settle_s: float = SETTLE_S     # how long a GitHub follow-up waits for more of the same review


def build_app(config: Config, layout: Layout, links: LinkSecrets, redactor: Redactor,
              options: SchedulerOptions = SchedulerOptions(), *,
              store: Store | None = None, sandboxes: BrokerSet | None = None,
              interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
              registry: CollectorRegistry | None = None) -> SchedulerApp:
    """The scheduler `options` describe. `store` (already open, e.g. PostgreSQL from
    AFE_DATABASE_URL) wins over `options.store_path`; `sandboxes`: brokers on other
    hosts (placement.py), else the local one. The store's statements run on its own
    thread, never on the event loop (store/worker.py)."""
    o = options
    store = threaded(store if store is not None else Store.sqlite(o.store_path or layout.store_file))
    # `sandbox`: brokers on other hosts (placement.py, --sandbox-broker); else the local one
    sandbox = sandboxes or SandboxClient(str(layout.socket("sandbox")), links.call.get("sandbox"))
    credentials = CredentialsClient(str(layout.socket("credentials")), links.call.get("credentials"))
    engine_registry = registry if registry is not None else CollectorRegistry()
    # brokers on other hosts: the workspace crosses the network through the contracts (remoteworkspace.py)
    workspaces = RemoteWorkspaces(credentials, sandboxes, config) if sandboxes is not None else credentials
    engine = Engine(config, store, sandbox, workspaces, redactor, max_running=o.max_running,
                    registry=engine_registry,
                    recovery_interval=o.recovery_interval, pool_dir=layout.data_dir / "pool", pool_cap=o.pool_cap,
                    owner=o.owner, lease_s=o.lease_s)
    intake = GitHubIntake(config, store, engine, credentials, registry=engine_registry, settle_s=o.github_settle_s)
    reporter = GitHubReporter(config, store, credentials, o.public_url)
    engine.transitions.listeners.append(reporter.changed)
    # The keys of the scheduler's callers; services/common/rpc/callers.py says which service each may call.
    accepted = grpcutil.CallerSecrets({k: v for k, v in links.serve.items()
                                       if k in callers.callers_of(callers.SERVES["scheduler"])})
    # Automation callers get server reflection too (behind the same key check) so generic tools work
    # without the .proto files; see docs/AUTOMATION.md.
    server = grpcutil.create_server(str(layout.socket("scheduler")), accepted, redactor,
                                    [register(SchedulerServicer(engine, o.watch_send_timeout)),
                                     register_hooks(intake)],
                                    interceptors=interceptors, registry=registry, reflection=True)
    key_file = AutomationKeyFile(layout.automation_key, accepted) if "automation" in links.serve else None
    return SchedulerApp(engine, store, sandbox, credentials, server, key_file, intake, Poller(intake), reporter)
