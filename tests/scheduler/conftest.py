"""Scheduler test helpers: config folders built on the demo repository, and
small waits over the real gRPC API."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import time
from pathlib import Path

import grpc

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.demo import make_repo
from services.common.layout import Layout
from services.common.states import TicketState
from tests.support.fakes.git_http import CLEAN_ENV

WORKSPACE = """\
kind: Workspace
name: ws
repo: repos/calc.git
baseBranch: main
forge: {type: local}
sandbox:
  image: afe/sandbox:latest
  limits: {cpus: 1, memory: 256m, pids: 128}
%s%s
"""

STATE = {s.proto: s.value for s in TicketState}


def write_config(root: Path, documents: str, *, workspace_extra: str = "", sandbox_extra: str = "",
                 files: dict[str, str] | None = None) -> Path:
    """A config folder with workspace `ws` (the demo's calc repository) plus `documents`."""
    cfg = root / "cfg"
    cfg.mkdir(parents=True, exist_ok=True)
    make_repo(cfg / "repos" / "calc.git")
    (cfg / "afe.yaml").write_text(WORKSPACE % (sandbox_extra, workspace_extra) + "---\n" + documents)
    for name, text in (files or {}).items():
        (cfg / name).write_text(text)
    return cfg


def state_name(t: pb.Ticket) -> str:
    return STATE[t.state]


async def wait_for_state(stub, ticket_id: str, states: set[str], deadline_s: float = 180) -> pb.Ticket:
    end = time.monotonic() + deadline_s
    while True:
        try:
            t = await stub.GetTicket(pb.GetTicketRequest(id=ticket_id))
        except grpc.aio.AioRpcError as exc:       # the store is away (a database outage): ask again, as a client does
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > end:
                raise
            await asyncio.sleep(0.2)
            continue
        if state_name(t) in states:
            return t
        if time.monotonic() > end:
            raise AssertionError(f"ticket {ticket_id} stayed {state_name(t)}; wanted {states}")
        await asyncio.sleep(0.1)


async def wait_for_event(stub, ticket_id: str, predicate, from_seq: int = 1, deadline_s: float = 180) -> pb.Event:
    async def scan():
        async for ev in stub.WatchTicket(pb.WatchTicketRequest(id=ticket_id, from_seq=from_seq, follow=True)):
            if predicate(ev):
                return ev
        raise AssertionError(f"ticket {ticket_id} finished without the awaited event")
    return await asyncio.wait_for(scan(), deadline_s)


async def all_events(stub, ticket_id: str) -> list[pb.Event]:
    return [ev async for ev in stub.WatchTicket(pb.WatchTicketRequest(id=ticket_id, from_seq=1, follow=False))]


def payload(ev: pb.Event) -> dict:
    return json.loads(ev.payload_json)


def git(bare: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(bare), *args], check=True, capture_output=True, text=True,
                          env=CLEAN_ENV).stdout


def forge_records(data_dir: Path, ticket_id: str) -> list[dict]:
    """Pull requests the local forge holds for this ticket's branch."""
    out = []
    for p in (data_dir / "forge").glob("*/*.json"):
        rec = json.loads(p.read_text())
        if rec.get("head") == f"afe/{ticket_id}":
            out.append(rec)
    return out


async def second_scheduler(sys_, root: Path):
    """Another scheduler process on the same database and brokers as `sys_`
    (a tests.support.system.System; its own socket and data folder, its log
    at root/b/scheduler.log)."""
    layout = Layout(root / "b" / "data", root / "b" / "run")
    layout.ensure()
    for service in ("sandbox", "credentials"):
        layout.socket(service).symlink_to(sys_.layout.socket(service))
    other = dataclasses.replace(sys_, layout=layout, proc=None, app=None, channel=None, stub=None)
    await other.start_scheduler()
    return other
