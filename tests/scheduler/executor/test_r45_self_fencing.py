"""Self-fencing and takeover attempts (R37, R45, docs/SCALE.md "Leases"): two
engines on one real PostgreSQL database, the brokers in-process fakes
(fakes.py), short leases. No Docker: each test takes a few seconds.

A scheduler that cannot reach its database is simulated at the store: the
statements it sends fail with `Unavailable`, as the store's own retries end
when the database does not answer, while the other scheduler's go through.

- R45: the owner whose renewals fail stops its node before its lease can end
  on the database's clock, so the scheduler taking the ticket over never
  runs the node beside it; positive control: without self-fencing the owner
  runs on past its lease while the other one re-runs the same node.
- The takeover is a new attempt (node_runs.attempt 2) that says so
  (`node.attempt`: reason, previous scheduler), starts from the workspace of
  the last completed node (RestoreWorkspace; the state after each node is
  kept by CheckpointWorkspace) and whose output carries the attempt; one
  commit, one push, one pull request in the end.
- Events the fenced-off attempt could not store are never written late:
  the scheduler that claims the ticket again says how many in `events.lost`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import psycopg
import pytest
from prometheus_client import CollectorRegistry

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.common.config.manifests import load_config
from services.common.errors import Unavailable
from services.common.secrecy.redact import Redactor
from services.scheduler.engine.core import Engine
from services.scheduler.store.base import N_RUNNING, RUNNING, SUCCEEDED, TERMINAL
from tests.support.postgres import open_store_url

from .conftest import WORKSPACE
from .fakes import FakeCredentials, FakeSandbox

pytestmark = pytest.mark.timeout(90)

LEASE_S = 2.0        # self-fencing margin 1 s: a lease is trusted for 1 s after its renewal was sent
EDIT = "echo one; open started; wait more; echo two; echo three; wait go; echo done"
WORKFLOWS = f"""\
kind: Workflow
name: fix
workspace: ws
nodes:
  - id: edit
    run: "{EDIT}"
  - id: pr
    uses: builtin:open_pr
    needs: [edit]
"""
DB_NOW = "(extract(epoch from clock_timestamp()) * 1000)::bigint"


class TimedSandbox(FakeSandbox):
    """The fake sandbox, noting when each command started and ended (local monotonic time) and,
    when one is cancelled, whether the ticket's lease was still valid on the database's clock."""

    def __init__(self, pg_url: str) -> None:
        super().__init__()
        self.pg_url = pg_url
        self.runs: list[dict] = []

    async def exec(self, ticket_id: str, argv: list[str], timeout_ms: int = 0, output_cap_bytes: int = 0,
                   cwd: str = "") -> AsyncIterator[spb.ExecEvent]:
        run = {"ticket": ticket_id, "start": time.monotonic(), "end": None, "how": "", "lease_left_ms": None}
        self.runs.append(run)
        try:
            async for ev in super().exec(ticket_id, argv, timeout_ms, output_cap_bytes, cwd):
                yield ev
            run["how"] = "exit"
        except asyncio.CancelledError:
            run["how"] = "cancelled"
            with psycopg.connect(self.pg_url, autocommit=True) as db:
                row = db.execute(f"SELECT lease_until_ms - {DB_NOW} FROM tickets WHERE id=%s", (ticket_id,)).fetchone()
            run["lease_left_ms"] = int(row[0]) if row else None
            raise
        finally:
            run["end"] = time.monotonic()


class Partition:
    """The database as one scheduler sees it through a network partition: while `down`, the
    named statements of its store fail with `Unavailable` (what the store raises once its own
    retries are spent); the other scheduler's store is not touched."""

    def __init__(self, store, *names: str) -> None:
        self.down = False
        store = store.__dict__.get("inner", store)      # the repositories themselves (not their thread's)
        for name in names:                              # "repository.method"
            repo_name, method = name.split(".")
            repo = getattr(store, repo_name)
            real = getattr(repo, method)

            def fail_while_down(*args, _real=real, _name=name, **kwargs):
                if self.down:
                    raise Unavailable(f"the database did not answer ({_name})")
                return _real(*args, **kwargs)

            setattr(repo, method, fail_while_down)


@pytest.fixture
async def pair(tmp_path, pg_url):
    """make(owner) -> an engine on the test database; all share the fake brokers."""
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "afe.yaml").write_text(WORKSPACE + WORKFLOWS)
    config = load_config(cfg)
    sandbox, credentials = TimedSandbox(pg_url), FakeCredentials()
    made: list[Engine] = []

    def make(owner: str) -> Engine:
        store = open_store_url(pg_url, tmp_path)
        engine = Engine(config, store, sandbox, credentials, Redactor(), registry=CollectorRegistry(),
                        recovery_interval=0, owner=owner, lease_s=LEASE_S)
        engine.broker_retry_s = 5.0
        made.append(engine)
        return engine

    yield make, sandbox, credentials
    for engine in made:
        await engine.stop()
        engine.store.close()


async def _until(predicate, deadline_s: float = 20.0, what: str = "") -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _events(engine: Engine, ticket_id: str, type_: str | None = None) -> list[tuple[str, dict]]:
    engine.events.flush()
    out = [(e.type, json.loads(e.payload_json)) for e in engine.store.events.read(ticket_id, 1, 100_000)]
    return [e for e in out if type_ is None or e[0] == type_]


async def _takeover_while_a_is_cut_off(pair, self_fencing: bool):
    make, sandbox, _credentials = pair
    a = make("sched-a")
    await a.start()
    a.leases.self_fencing = self_fencing
    cut = Partition(a.store, "leases.renew", "leases.claim")
    tid = a.create_ticket("", "fix", "notes", "", {}, "tester").ticket.id
    b = make("sched-b")
    await b.start()
    await _until(lambda: sandbox.gate("started").is_set(), what="A's command to start")
    cut.down = True                             # A can no longer renew its lease
    sandbox.open("more")
    # B takes the ticket over once A's lease ran out on the database's clock, and runs `edit` again
    await _until(lambda: len(sandbox.runs) == 2, what="the other scheduler's run of the node")
    return a, b, tid


async def test_r45_an_owner_that_cannot_renew_stops_its_node_before_its_lease_ends(pair):
    _make, sandbox, credentials = pair
    a, b, tid = await _takeover_while_a_is_cut_off(pair, self_fencing=True)
    first, second = sandbox.runs
    assert first["how"] == "cancelled" and first["end"] is not None
    # A stopped acting while its lease was still valid on the database's clock ...
    assert first["lease_left_ms"] is not None and first["lease_left_ms"] > 0, first
    # ... so B's attempt started only after A's had stopped: never side by side
    assert first["end"] <= second["start"]
    assert a.lease_lost(tid) and not a.running_here(tid)
    assert a.store.tickets.get(tid).state == RUNNING

    sandbox.open("go")
    await _until(lambda: b.store.tickets.get(tid).state in TERMINAL, what="the ticket's end")
    t = b.store.tickets.get(tid)
    assert t.state == SUCCEEDED, t.error
    edit = next(n for n in b.store.tickets.node_runs(tid) if n.node_id == "edit")
    # attempt 2 is B's; on a loaded machine B may miss its own renewals and fence itself too (a
    # third attempt, again only after the one before it stopped): never fewer, never side by side
    assert edit.attempt >= 2 and edit.output.endswith("done\n")
    [(_, again)] = _events(b, tid, "node.attempt")
    assert again == {"node": "edit", "attempt": 2, "previous": 1, "reason": "takeover",
                     "previous_scheduler": "sched-a", "scheduler": "sched-b"}
    outputs = [(p["attempt"], p["text"]) for _, p in _events(b, tid, "node.output") if p["node"] == "edit"]
    assert [x for x in outputs if x[0] == 2] == [(2, "one\n"), (2, "two\n"), (2, "three\n"), (2, "done\n")]
    assert all(text != "done\n" for n, text in outputs if n == 1)      # attempt 1 never finished
    started = [p["scheduler"] for _, p in _events(b, tid, "node.started") if p["node"] == "edit"]
    assert started == ["sched-a", "sched-b"]
    # attempt 2 started from the workspace of the last completed node (none: the branch head), not
    # attempt 1's files, and the state after `edit` was kept before it counted as done
    assert credentials.restored == [(tid, "")] and credentials.checkpoints == [(tid, "edit")]
    types = [t for t, _ in _events(b, tid)]
    [(_, restored)] = _events(b, tid, "workspace.restored")
    assert restored == {"after": "", "attempt": 2, "restored": True, "sha": "k" * 40}
    assert types.index("workspace.restored") < max(i for i, t in enumerate(types) if t == "node.started")
    # the builtin ran once, by the new owner: one commit, one push, one pull request
    assert credentials.calls.count("commit") == 1 and credentials.calls.count("push") == 1
    assert credentials.calls.count("open_pr") == 1 and len(credentials.prs) == 1
    finished = [p for _, p in _events(b, tid, "node.finished") if p["node"] == "edit"]
    assert [p["attempt"] for p in finished] == [2]


async def test_r45_positive_control_without_self_fencing_the_owner_runs_on_beside_the_takeover(pair):
    _make, sandbox, _credentials = pair
    _a, b, tid = await _takeover_while_a_is_cut_off(pair, self_fencing=False)
    first, second = sandbox.runs
    # A never stopped: its command still runs after B took the ticket over and started its own
    assert first["end"] is None and second["end"] is None
    sandbox.open("go")
    await _until(lambda: first["end"] is not None and second["end"] is not None, what="both commands' end")
    assert first["how"] == "exit" and second["how"] == "exit"                  # both ran to the end ...
    assert first["end"] > second["start"]                                       # ... side by side
    await _until(lambda: b.store.tickets.get(tid).state in TERMINAL, what="the ticket's end")
    assert b.store.tickets.get(tid).state == SUCCEEDED


async def test_r45_a_scheduler_cut_off_from_its_database_drops_its_unstored_events_and_counts_them(pair):
    """One scheduler: its database stops answering while a node prints; it fences itself off in
    time, drops the events it could not store, and once the database answers again claims the
    ticket again: the new attempt starts with `events.lost` counting them, then `node.attempt`."""
    make, sandbox, _credentials = pair
    a = make("sched-a")
    await a.start()
    cut = Partition(a.store, "leases.renew", "leases.claim", "events.append", "tickets.update_node",
                    "tickets.update")
    tid = a.create_ticket("", "fix", "notes", "", {}, "tester").ticket.id
    await _until(lambda: sandbox.gate("started").is_set(), what="the command to start")
    await _until(lambda: not a.events.holds_unstored(tid), what="the first events stored")
    stored_before = a.store.events.last_seq(tid)
    cut.down = True
    sandbox.open("more")                         # "two", "three": printed while nothing can be stored
    await _until(lambda: a.lease_lost(tid), deadline_s=LEASE_S * 2, what="self-fencing")
    await _until(lambda: sandbox.runs[0]["how"] == "cancelled", what="the node's command stopped")
    assert sandbox.runs[0]["lease_left_ms"] > 0
    assert a.store.events.last_seq(tid) == stored_before           # nothing of the fenced-off attempt was written
    cut.down = False                              # the database answers again
    await _until(lambda: len(sandbox.runs) == 2, what="the attempt that claims the ticket again")
    sandbox.open("go")
    await _until(lambda: a.store.tickets.get(tid).state in TERMINAL, what="the ticket's end")
    assert a.store.tickets.get(tid).state == SUCCEEDED

    events = _events(a, tid)
    types = [t for t, _ in events]
    i = types.index("events.lost")
    lost = events[i][1]
    # node.output "two" and "three" never reached the database: counted, and said first in the new attempt
    assert lost["count"] == 2 and lost["attempt"] == 1 and "self-fencing" in lost["reason"], lost
    assert types[i + 1] == "node.attempt" and events[i + 1][1]["reason"] == "self_fenced"
    assert events[i + 1][1]["previous_scheduler"] == "sched-a" and events[i + 1][1]["attempt"] == 2
    texts = [(p["attempt"], p["text"]) for t, p in events if t == "node.output"]
    assert (1, "two\n") not in texts and (2, "two\n") in texts
    seqs = [e.seq for e in a.store.events.read(tid, 1, 100_000)]
    assert seqs == list(range(1, len(seqs) + 1))           # gap-free: nothing renumbered in late
    assert next(n for n in a.store.tickets.node_runs(tid) if n.node_id == "edit").attempt == 2
    assert N_RUNNING not in {n.state for n in a.store.tickets.node_runs(tid)}


@pytest.mark.parametrize("barrier", [True, False], ids=["fence-kept-until-the-queue-is-through", "positive-control"])
async def test_r45_a_batch_still_queued_when_the_owner_fences_itself_off_is_never_written(pair, barrier):
    """The scheduler's store on its own thread (as in the scheduler): a batch of the node's output
    is on that thread, held (the database does not answer it), when the owner fences itself off.
    The lost fence is kept until every statement queued there has met it: the batch is refused and
    counted. Positive control: the fence forgotten once the run has stopped (what the engine did
    before) lets the held batch through, unchecked: the old attempt's lines land after it was lost."""
    import threading

    from services.scheduler.store.worker import ThreadedStore

    make, sandbox, _credentials = pair
    a = make("sched-a")
    inner = a.store
    threaded = ThreadedStore(inner)
    a2 = Engine(a.config, threaded, a.sandbox, a.credentials, Redactor(), registry=CollectorRegistry(),
                recovery_interval=0, owner="sched-a2", lease_s=LEASE_S)
    a2.broker_retry_s = 5.0
    held, release = threading.Event(), threading.Event()
    real_append = inner.events.append

    def append_held(events):
        if any(ev[2] == "node.output" and "two" in ev[3] for ev in events):
            held.set()
            release.wait(20)             # the database does not answer this batch (yet)
        return real_append(events)
    inner.events.append = append_held
    try:
        await a2.start()
        tid = a2.create_ticket("", "fix", "notes", "", {}, "tester").ticket.id
        await _until(lambda: sandbox.gate("started").is_set(), what="the command to start")
        sandbox.open("more")                       # "two", "three": their batch is held on the store's thread
        await _until(held.is_set, what="the batch on the store's thread")
        await _until(lambda: a2.lease_lost(tid), deadline_s=LEASE_S * 5, what="self-fencing")
        await _until(lambda: not a2.running_here(tid), what="the run to stop")
        await asyncio.sleep(0.3)
        if not barrier:
            a2.leases.forget(tid)                   # what the engine before did once the run had stopped
        release.set()                               # the database answers the held batch now
        await _until(lambda: not a2.events.holds_unstored(tid), what="the held batch's outcome")
        await asyncio.sleep(0.5)
        outputs = [json.loads(e.payload_json) for e in inner.events.read(tid, 1, 100_000) if e.type == "node.output"]
        first = [p["text"] for p in outputs if p["attempt"] == 1]
        if barrier:
            assert first == ["one\n"], first      # the held batch was refused: the fence was still marked lost
            await _until(lambda: any(t == "events.lost" for t, _ in _events(a2, tid)), what="the next attempt")
            lost = [p for _, p in _events(a2, tid, "events.lost")]
            assert [(p["count"], p["attempt"]) for p in lost] == [(2, 1)], lost
        else:
            assert first == ["one\n", "two\n", "three\n"], first   # written after the owner lost the ticket
    finally:
        release.set()
        await a2.stop()
        threaded.close()
