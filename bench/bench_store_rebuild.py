"""Issue 32's `make bench` figures (the store rebuilt, fenced on every write),
each a ratio against a baseline measured in the same run:

- events/s appended through the EventLog into PostgreSQL, the ticket held
  with its fence as a scheduler holds it (so every batch carries the fence
  check), its store on its own thread, and delivered to a live watcher, vs a
  raw batched `executemany` of prebuilt rows into the same table of the same
  database. Target >= 0.5x, as the SQLite figure of issue 5
  (bench_scheduler.py) has it.
- a ticket's first output (CreateTicket -> the first `node.output` its live
  watcher gets; bench/first_output_probe.py) with this tree vs with commit
  63decdc, the code before issue 32, exported by `git archive` into a
  temporary folder and run the same way in the same run (brokers and
  scheduler of each tree), alternately, on SQLite and on PostgreSQL. Target
  <= 1.1x ("no slower than today": p50s of 10 samples move about that much
  on a shared 2-core machine).

Two schedulers against one on the same PostgreSQL is bench_schedulers.py's
figure (>= 0.9x).

    .venv/bin/python -m bench.bench_store_rebuild
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import Result
from tests.support.temp_roots import remove_temp_root, temp_root

ISSUE = 32
BEFORE_ISSUE_32 = "63decdc89186f0f9fb05c497b6a9dafa2805d789"
REPO = Path(__file__).resolve().parents[1]
EVENTS = 20000
EVENT_ROUNDS = 5
PROBE_ROUNDS = 2       # each round: one probe process per tree and database, their order swapped every round
PROBE_SAMPLES = 5


def _create(store: Any, ticket: Any, nodes: list, first: list) -> None:
    """A ticket in the store, through its tickets repository (the rebuilt store) or the older interface."""
    if hasattr(store, "create_ticket"):
        store.create_ticket(ticket, nodes, first)
    else:
        store.tickets.create(ticket, nodes, first)


def _claim(store: Any, ticket_id: str, states: tuple[str, ...], lease_ms: int) -> int | None:
    """Hold the ticket with a fence, as the scheduler does before it runs it."""
    if hasattr(store, "claim_ticket"):
        return store.claim_ticket(ticket_id, states, lease_ms)
    return store.leases.claim(ticket_id, states, lease_ms)


async def _pg_events(root: Path) -> list[Result]:
    import psycopg

    from services.common.secrecy.redact import Redactor
    from services.scheduler.events.log import FLUSH_AT, EventLog
    from services.scheduler.store.base import QUEUED, EventRecord, NodeRunRecord, TicketRecord
    from services.scheduler.store.worker import threaded
    from tests.support import postgres

    server = postgres.start_server()
    try:
        url = server.app_url(server.fresh_database())
        store = threaded(postgres.open_store_url(url, root))
        store.owner = "bench"
        redactor = Redactor()
        redactor.register("a-registered-secret-value")
        log = EventLog(store, redactor)
        raw = psycopg.connect(url, autocommit=True)
        ours, base, copied = [], [], []
        for r in range(EVENT_ROUNDS):
            tid, raw_tid = f"t-bench{r}", f"t-raw{r}"
            for t in (tid, raw_tid):
                _create(store, TicketRecord(id=t, workspace="ws", workflow="wf", title="t", body="", inputs={},
                                            state=QUEUED, created_at_ms=1, updated_at_ms=1),
                        [NodeRunRecord(t, "test", "run")], [EventRecord(t, 1, "ticket.created", "{}", 1)])
            if _claim(store, tid, (QUEUED,), 600_000) is None:
                raise RuntimeError(f"the bench could not claim its ticket {tid}")
            got = 0

            async def watcher(tid: str = tid) -> None:
                nonlocal got
                async for _ev in log.watch(tid, 2, True, lambda: False):
                    got += 1
                    if got == EVENTS:
                        return

            w = asyncio.create_task(watcher())
            await asyncio.sleep(0)
            t0 = time.perf_counter()
            for i in range(EVENTS):
                log.append(tid, "node.output", {"node": "test", "stream": "stdout",
                                                "text": f"line {i}: ok test_something ({i % 97} ms)"})
                if i % 256 == 255:
                    await asyncio.sleep(0)
            log.flush()
            await w
            ours.append(EVENTS / (time.perf_counter() - t0))

            rows = [(raw_tid, i + 2, "node.output",
                     json.dumps({"node": "test", "stream": "stdout", "text": f"line {i}: ok test_something"}), 0)
                    for i in range(EVENTS)]
            t0 = time.perf_counter()
            with raw.cursor() as cur:
                for j in range(0, EVENTS, FLUSH_AT):   # the pipeline's largest batch, one transaction each
                    with raw.transaction():
                        cur.executemany("INSERT INTO events (ticket_id, seq, type, payload_json, at_ms) "
                                        "VALUES (%s,%s,%s,%s,%s)", rows[j:j + FLUSH_AT])
            base.append(EVENTS / (time.perf_counter() - t0))

            t0 = time.perf_counter()      # the fastest raw way, for scale: COPY in the same batches
            with raw.cursor() as cur:
                for j in range(0, EVENTS, FLUSH_AT):
                    with raw.transaction(), cur.copy("COPY events (ticket_id, seq, type, payload_json, at_ms) "
                                                     "FROM STDIN") as copy:
                        for row in rows[j:j + FLUSH_AT]:
                            copy.write_row((f"t-copy{r}", *row[1:]))
            copied.append(EVENTS / (time.perf_counter() - t0))
        raw.close()
        store.close()
    finally:
        postgres.stop_server(server)
    med = statistics.median
    name = "events/s appended into PostgreSQL, the ticket held with its fence, and delivered to a watcher"
    return [Result(ISSUE, name, "raw batched executemany of prebuilt rows into the same table",
                   med(ours), med(base), 0.5, higher_is_better=True,
                   notes=f"{med(ours):.0f} vs {med(base):.0f} events/s, medians of {EVENT_ROUNDS} rounds of {EVENTS}"),
            Result(ISSUE, name, "raw COPY of the same rows in the same batches (the fastest raw way)",
                   med(ours), med(copied), None, higher_is_better=True,
                   notes=f"{med(ours):.0f} vs {med(copied):.0f} events/s; for scale, no target")]


def _child_env(**extra: str) -> dict[str, str]:
    """An environment of the child's own (R33's habit): the basics, nothing else of this process's."""
    return {**{k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}, **extra}


def _export_before(dest: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", BEFORE_ISSUE_32], capture_output=True,
                             check=True, env=_child_env()).stdout
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, env=_child_env())
    probe = Path(__file__).with_name("first_output_probe.py")
    (dest / "bench" / probe.name).write_bytes(probe.read_bytes())
    return dest


def _probe(tree: Path, db: str) -> list[float]:
    proc = subprocess.run([sys.executable, "-m", "bench.first_output_probe", "--db", db,
                           "--samples", str(PROBE_SAMPLES)], cwd=tree, env=_child_env(PYTHONPATH=str(tree)),
                          capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"first_output_probe in {tree} ({db}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _first_output(root: Path) -> list[Result]:
    before = _export_before(root / "before")
    trees = {"this tree": REPO, "63decdc": before}
    got: dict[tuple[str, str], list[float]] = {(t, db): [] for t in trees for db in ("sqlite", "pg")}
    for r in range(PROBE_ROUNDS):
        order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
        for db in ("sqlite", "pg"):
            for name, tree in order:
                got[(name, db)] += _probe(tree, db)
    med = statistics.median
    out = []
    for db, label in (("sqlite", "SQLite"), ("pg", "PostgreSQL")):
        ours, base = got[("this tree", db)], got[("63decdc", db)]
        out.append(Result(ISSUE, f"a ticket's first output (created -> first node.output watched), {label}, p50",
                          "the same with the code before issue 32 (63decdc), same run",
                          med(ours), med(base), 1.1,
                          notes=f"{len(ours)} samples each; ours {min(ours):.2f}-{max(ours):.2f} s, "
                                f"63decdc {min(base):.2f}-{max(base):.2f} s"))
    return out


def run(out_dir) -> list[Result]:
    root = temp_root("afe-b32-")
    try:
        results = asyncio.run(_pg_events(root))
        results += _first_output(root)
        return results
    finally:
        remove_temp_root(root)


if __name__ == "__main__":
    for r in run("bench/out"):
        print(f"{r.name}: {r.measured_s:.4f} vs {r.baseline_s:.4f} -> {r.ratio:.2f} "
              f"(target {'>=' if r.higher_is_better else '<='} {r.target}) {'MET' if r.met else 'NOT MET'} {r.notes}")
