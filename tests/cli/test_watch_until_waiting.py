"""`afe ticket watch --until-waiting` on a ticket that waited, was approved or
followed up, and waits again: the whole history is printed and the watch
stops at the CURRENT wait, never at the first approval request. Through the
real gateway process and the real scheduler core (its engine not started:
the test writes the ticket's history with the engine's own event log).
Positive control: the watch as it was stops after the first request."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.cli import tickets as cli
from services.cli.rpc_client import RpcClient
from services.common.config.manifests import load_config
from services.common.layout import Layout
from services.common.rpc.links import LinkSecrets, new_secret
from services.common.secrecy.redact import Redactor
from services.common.secrecy.tokenfile import write_token_file
from services.scheduler.app import SchedulerOptions, build_app
from services.scheduler.store.base import RUNNING, WAITING_APPROVAL
from tests.gateway.conftest import start_gateway

pytestmark = pytest.mark.timeout(120)

CONFIG = """\
kind: Workspace
name: ws
repo: repos/calc.git
forge: {type: local}
---
kind: Model
name: scripted
provider: replay
script: none.yaml
---
kind: Workflow
name: iterate
workspace: ws
nodes:
  - {id: think, model: scripted, prompt: "Fix it", tools: []}
  - {id: gate, uses: builtin:approval, needs: [think]}
"""
H1, H2 = "1" * 40, "2" * 40


@pytest.fixture
async def afe_rpc():
    root = Path(tempfile.mkdtemp(prefix="afe-watch-", dir="/tmp"))
    cfg = root / "cfg"
    cfg.mkdir()
    (cfg / "afe.yaml").write_text(CONFIG)
    (cfg / "none.yaml").write_text("[]\n")
    layout = Layout(root / "data", root / "run")
    layout.ensure()
    write_token_file(layout.token_file)
    link = LinkSecrets(serve={"gateway": new_secret(), "automation": new_secret()}, call={})
    app = build_app(load_config(cfg), layout, link, Redactor(), SchedulerOptions(recovery_interval=0),
                    registry=CollectorRegistry())
    await app.server.start()      # engine not started: the history is the test's
    gw = await asyncio.to_thread(start_gateway, layout, link.serve["gateway"], config_dir=cfg)
    try:
        async with RpcClient(gw.url, layout.token_file.read_text().strip()) as client:
            yield app, client
    finally:
        await asyncio.to_thread(gw.stop)
        await app.server.stop(0)
        await app.credentials.close()
        await app.sandbox.close()
        app.store.close()
        shutil.rmtree(root, ignore_errors=True)


def _event(app, tid: str, type_: str, payload: dict) -> None:
    app.engine.events.append(tid, type_, payload)
    app.engine.events.flush()


def _wait(app, tid: str, sha: str) -> None:
    _event(app, tid, "approval.requested", {"node": "gate", "sha": sha, "pr": "1", "url": ""})
    app.store.tickets.update(tid, state=WAITING_APPROVAL, awaiting_sha=sha)


def _history(app) -> str:
    """Waited for H1, approved, followed up, ran and waits for H2; its last event after the request."""
    tid = app.engine.create_ticket("ws", "iterate", "Fix add()", "", {}, "alice").ticket.id
    _event(app, tid, "node.started", {"node": "think"})
    _wait(app, tid, H1)
    _event(app, tid, "approval.granted", {"node": "gate", "sha": H1, "principal": "bob"})
    _event(app, tid, "ticket.reopened", {"principal": "bob", "reason": "follow-up"})
    app.store.tickets.update(tid, state=RUNNING)
    _event(app, tid, "node.started", {"node": "think"})
    _wait(app, tid, H2)
    _event(app, tid, "followup.received", {"source": "github:review", "taken": "followup"})
    return tid


def _args() -> argparse.Namespace:
    return argparse.Namespace(json=True, until_waiting=True, verbose=False)


def _printed(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


async def _old_follow(client: RpcClient, ticket_id: str, args: argparse.Namespace) -> int:
    """The watch before: it stopped at the first approval request that found the ticket waiting."""
    t = await client.call("tickets.get", {"id": ticket_id})
    settled = t["state"] in cli.TERMINAL or (args.until_waiting and t["state"] == "waiting_approval")
    async for e in client.watch(ticket_id, follow=not settled):
        cli._emit_json(e)
        if args.until_waiting and e["type"] == "approval.requested":
            t = await client.call("tickets.get", {"id": ticket_id})
            if t["state"] == "waiting_approval":
                break
    return cli.EXIT_WAITING


@pytest.mark.parametrize("follow", [cli._follow, _old_follow], ids=["watch", "positive-control-old-watch"])
async def test_until_waiting_prints_the_whole_history_and_stops_at_the_current_wait(afe_rpc, capsys, follow):
    app, client = afe_rpc
    tid = _history(app)
    last = app.engine.view(tid).last_seq
    assert await follow(client, tid, _args()) == cli.EXIT_WAITING
    printed = _printed(capsys.readouterr().out)
    seqs = [e["seq"] for e in printed]
    requests = [e["payload"]["sha"] for e in printed if e["type"] == "approval.requested"]
    if follow is _old_follow:
        assert requests == [H1] and seqs[-1] < last          # cut off at the first wait
        return
    assert seqs == list(range(1, last + 1))
    assert requests == [H1, H2] and printed[-1]["type"] == "followup.received"


async def test_until_waiting_live_goes_past_an_earlier_wait_and_stops_at_the_new_one(afe_rpc, capsys):
    app, client = afe_rpc
    tid = app.engine.create_ticket("ws", "iterate", "Fix add()", "", {}, "alice").ticket.id
    _wait(app, tid, H1)
    _event(app, tid, "ticket.reopened", {"principal": "bob", "reason": "follow-up"})
    app.store.tickets.update(tid, state=RUNNING)                      # running again: the watch follows it
    watch = asyncio.create_task(cli._follow(client, tid, _args()))
    await asyncio.sleep(1.0)
    assert not watch.done()                                          # not stopped at the earlier request
    _wait(app, tid, H2)
    assert await asyncio.wait_for(watch, 30) == cli.EXIT_WAITING
    requests = [e["payload"]["sha"] for e in _printed(capsys.readouterr().out) if e["type"] == "approval.requested"]
    assert requests == [H1, H2]
