"""The executor's fast tier: the real Engine, store (SQLite in a temp folder)
and executor, with the two brokers replaced by in-process fakes (fakes.py).
No Docker, no gRPC: every test here runs in well under a second."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Collection
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.common.config.manifests import load_config
from services.common.secrecy.redact import Redactor
from services.scheduler.engine.core import Engine
from services.scheduler.store.base import TERMINAL, NodeRunRecord, TicketRecord
from services.scheduler.store.store import Store

from .fakes import FakeCredentials, FakeSandbox

WORKSPACE = """\
kind: Workspace
name: ws
repo: repos/calc.git
baseBranch: main
forge: {type: local}
sandbox:
  image: afe/sandbox:latest
---
"""


class Harness:
    """An engine over fakes; `restart()` stops it and opens the same store again."""

    def __init__(self, root: Path, workflows: str) -> None:
        cfg = root / "cfg"
        cfg.mkdir()
        (cfg / "afe.yaml").write_text(WORKSPACE + workflows)
        self.config = load_config(cfg)
        self.db = root / "afe.db"
        self.sandbox = FakeSandbox()
        self.credentials = FakeCredentials()
        self.engine: Engine | None = None
        self.store: Store | None = None

    async def start(self) -> Engine:
        self.store = Store.sqlite(self.db)
        self.engine = Engine(self.config, self.store, self.sandbox, self.credentials, Redactor(),
                             registry=CollectorRegistry(), recovery_interval=0)
        self.engine.broker_retry_s = 5.0
        await self.engine.start()
        return self.engine

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.stop()
            self.engine = None
        if self.store is not None:
            self.store.close()
            self.store = None

    async def restart(self) -> Engine:
        await self.stop()
        return await self.start()

    def create(self, workflow: str, title: str = "a ticket") -> str:
        assert self.engine is not None
        return self.engine.create_ticket("", workflow, title, "", {}, "tester").ticket.id

    async def until(self, ticket_id: str, states: Collection[str] = TERMINAL, deadline_s: float = 5.0) -> TicketRecord:
        assert self.store is not None
        async with asyncio.timeout(deadline_s):
            while True:
                t = self.store.tickets.get(ticket_id)
                if t is not None and t.state in states:
                    return t
                await asyncio.sleep(0.005)

    async def gate(self, name: str, deadline_s: float = 5.0) -> None:
        """Wait until a command opened gate `name`."""
        async with asyncio.timeout(deadline_s):
            await self.sandbox.gate(name).wait()

    def nodes(self, ticket_id: str) -> dict[str, NodeRunRecord]:
        assert self.store is not None
        return {n.node_id: n for n in self.store.tickets.node_runs(ticket_id)}

    def events(self, ticket_id: str, type_: str | None = None) -> list[tuple[str, dict]]:
        assert self.engine is not None and self.store is not None
        self.engine.events.flush()
        out = [(e.type, json.loads(e.payload_json)) for e in self.store.events.read(ticket_id, 1, 100_000)]
        return [e for e in out if type_ is None or e[0] == type_]


@pytest.fixture
async def harness(tmp_path):
    made: list[Harness] = []

    def make(workflows: str) -> Harness:
        h = Harness(tmp_path, workflows)
        made.append(h)
        return h

    yield make
    for h in made:
        await h.stop()
