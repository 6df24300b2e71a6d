"""Scheduler benchmarks (issue 5), each a ratio against a same-run baseline.

- Orchestration overhead: a 50-node chain of `run: "true"` (after a setup
  node that pays for the workspace and the sandbox; scheduler in the bench
  process, like the baseline's client) vs the same 50 execs sent straight
  to the sandbox broker right after, in the same sandbox (kept alive by a
  last `sleep` node). Target <= 1.05x.
- Event pipeline: events/s appended through the EventLog (its store on its
  own thread, as in the scheduler) and delivered to a live watcher vs a raw
  batched `executemany` into the same SQLite file.
  Target >= 0.5x (higher is better).
- Time to first command: ticket created -> first output of its first command,
  warm mirror cache, vs a bare `docker run` of the same image plus a
  `git clone` from the local mirror. p50, target <= 1.5x.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import time
from pathlib import Path

from bench.common import Result
from tests.support.temp_roots import remove_temp_root, temp_root

ISSUE = 5
ROUNDS = 4
CHAIN = 50
EVENTS = 30000
EVENT_ROUNDS = 9   # ours and the baseline alternate; medians of 9 (0.3 s each) ride out load spikes
TTFC_SAMPLES = 5
# The scheduler runs in the bench process, like the baseline's client: both
# share the in-process broker's event loop, so the ratio is orchestration only.
SCHEDULER_SUBPROCESS = False

CONFIG = """\
kind: Workspace
name: ws
repo: repos/calc.git
baseBranch: main
forge: {type: local}
---
kind: Workflow
name: chain
workspace: ws
nodes:
%s
---
kind: Workflow
name: first
workspace: ws
nodes:
  - {id: first, run: "echo go"}
"""


def _config(root: Path) -> Path:
    from services.common.demo import make_repo

    cfg = root / "cfg"
    cfg.mkdir(parents=True)
    make_repo(cfg / "repos" / "calc.git")
    # `setup` pays for the workspace and the sandbox; the chain is timed after it.
    nodes = ['  - {id: setup, run: "true"}']
    for i in range(CHAIN):
        needs = f"n{i - 1}" if i else "setup"
        nodes.append(f'  - {{id: n{i}, run: "true", needs: [{needs}]}}')
    # `hold` keeps the same sandbox alive for the baseline's execs right after.
    nodes.append(f'  - {{id: hold, run: "sleep 600", needs: [n{CHAIN - 1}]}}')
    (cfg / "afe.yaml").write_text(CONFIG % "\n".join(nodes))
    return cfg


async def _wait(stub, pb, ticket_id: str, states: set) -> object:
    while True:
        t = await stub.GetTicket(pb.GetTicketRequest(id=ticket_id))
        if t.state in states:
            return t
        await asyncio.sleep(0.05)


async def _system_benches(root: Path) -> list[Result]:
    from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
    from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
    from services.common.layout import Layout
    from tests.support.system import afe_system

    cfg = _config(root)
    layout = Layout(root / "data", root / "run")
    done = {pb.TICKET_STATE_SUCCEEDED, pb.TICKET_STATE_FAILED, pb.TICKET_STATE_CANCELLED}
    ours_chain, base_chain, ours_first, base_first = [], [], [], []
    async with afe_system(cfg, layout, subprocess=SCHEDULER_SUBPROCESS) as sys_:
        stub = sys_.stub
        # Warm the mirror and the image cache.
        t = await stub.CreateTicket(pb.CreateTicketRequest(workflow="first", title="warm"))
        await _wait(stub, pb, t.id, done)

        for _ in range(ROUNDS):
            t = await stub.CreateTicket(pb.CreateTicketRequest(workflow="chain", title="chain"))
            # Poll rarely: the bench shares the scheduler's event loop, and a
            # watcher or frequent polls would load it while the chain runs.
            while True:
                await asyncio.sleep(0.5)
                t = await stub.GetTicket(pb.GetTicketRequest(id=t.id))
                if t.nodes[-1].state == pb.NODE_STATE_RUNNING or t.state in done:
                    break
            if t.state in done:
                raise RuntimeError(f"chain ticket ended early: {t.error}")
            ours_chain.append((t.nodes[-2].finished_at_ms - t.nodes[0].finished_at_ms) / 1000)
            await asyncio.sleep(0.2)
            # The baseline: the same 50 execs, straight to the broker, in the same sandbox.
            t0 = time.perf_counter()
            for _i in range(CHAIN):
                req = spb.ExecRequest(ticket_id=t.id, argv=["bash", "-lc", "true"], timeout_ms=1_800_000,
                                      output_cap_bytes=4 * 1024 * 1024)
                async for ev in sys_.sandbox.Exec(req):
                    if ev.WhichOneof("event") == "exit" and ev.exit.code != 0:
                        raise RuntimeError("baseline exec failed")
            base_chain.append(time.perf_counter() - t0)
            await stub.CancelTicket(pb.CancelTicketRequest(id=t.id, principal="bench"))

        for _ in range(TTFC_SAMPLES):
            t0 = time.time()
            t = await stub.CreateTicket(pb.CreateTicketRequest(workflow="first", title="first"))
            async for ev in stub.WatchTicket(pb.WatchTicketRequest(id=t.id, from_seq=1, follow=True)):
                if ev.type == "node.output":
                    ours_first.append(ev.at_ms / 1000 - t0)
                    break
            await _wait(stub, pb, t.id, done)

        mirrors = [p for p in layout.mirrors_dir.rglob("*") if p.is_dir() and (p / "HEAD").exists()]
        mirror = mirrors[0] if mirrors else cfg / "repos" / "calc.git"
        for i in range(TTFC_SAMPLES):
            dest = root / f"clone{i}"
            t0 = time.perf_counter()
            await asyncio.to_thread(subprocess.run, ["docker", "run", "--rm", "--network", "none",
                                                     "afe/sandbox:latest", "echo", "go"],
                                    check=True, capture_output=True)
            await asyncio.to_thread(subprocess.run, ["git", "clone", "-q", str(mirror), str(dest)],
                                    check=True, capture_output=True)
            base_first.append(time.perf_counter() - t0)

    med = statistics.median
    return [
        Result(ISSUE, "50-node chain of run: true (sandbox ready -> last node finished)",
               "the same 50 execs sent straight to the sandbox broker",
               med(ours_chain), med(base_chain), 1.05,
               notes=f"per node: {med(ours_chain) / CHAIN * 1000:.1f} ms vs {med(base_chain) / CHAIN * 1000:.1f} ms"),
        Result(ISSUE, "time to first command (ticket created -> first output), warm mirror, p50",
               "docker run of the same image + git clone from the local mirror",
               med(ours_first), med(base_first), 1.5),
    ]


async def _event_pipeline(root: Path) -> Result:
    import sqlite3

    from services.common.secrecy.redact import Redactor
    from services.scheduler.events.log import FLUSH_AT, EventLog
    from services.scheduler.store.store import Store
    from services.scheduler.store.worker import threaded

    path = root / "events.db"
    store = threaded(Store.sqlite(path))     # as the scheduler has it: statements on the store's thread
    redactor = Redactor()
    redactor.register("a-registered-secret-value")
    log = EventLog(store, redactor)
    raw = sqlite3.connect(str(path), isolation_level=None)
    ours, base = [], []
    for r in range(EVENT_ROUNDS):
        tid = f"t-bench{r}"
        got = 0

        async def watcher(tid: str = tid) -> None:
            nonlocal got
            async for _ev in log.watch(tid, 1, True, lambda: False):
                got += 1
                if got == EVENTS:
                    return

        w = asyncio.create_task(watcher())
        await asyncio.sleep(0)
        store.checkpoint()   # both timed runs start from an empty WAL (untimed)
        t0 = time.perf_counter()
        for i in range(EVENTS):
            log.append(tid, "node.output", {"node": "test", "stream": "stdout",
                                            "text": f"line {i}: ok test_something ({i % 97} ms)"})
            if i % 256 == 255:
                await asyncio.sleep(0)
        log.flush()
        await w
        ours.append(EVENTS / (time.perf_counter() - t0))

        rows = [(f"t-raw{r}", i + 1, "node.output",
                 json.dumps({"node": "test", "stream": "stdout", "text": f"line {i}: ok test_something"}), 0)
                for i in range(EVENTS)]
        store.checkpoint()
        t0 = time.perf_counter()
        for j in range(0, EVENTS, FLUSH_AT):   # the same batch size as the pipeline's largest
            raw.execute("BEGIN")
            raw.executemany("INSERT INTO events (ticket_id, seq, type, payload_json, at_ms) VALUES (?,?,?,?,?)",
                            rows[j:j + FLUSH_AT])
            raw.execute("COMMIT")
        base.append(EVENTS / (time.perf_counter() - t0))
    raw.close()
    store.close()
    return Result(ISSUE, "events/s appended (redacted, stored) and delivered to a watcher",
                  "raw batched executemany of prebuilt rows into the same SQLite file",
                  statistics.median(ours), statistics.median(base), 0.5, higher_is_better=True,
                  notes=f"{statistics.median(ours):.0f} vs {statistics.median(base):.0f} events/s")


async def _all(out_dir: Path) -> list[Result]:
    root = temp_root("afe-bs-")
    try:
        results = [await _event_pipeline(root)]
        results += await _system_benches(root)
        return results
    finally:
        remove_temp_root(root)


def run(out_dir) -> list[Result]:
    return asyncio.run(_all(Path(out_dir)))


if __name__ == "__main__":
    for r in run("bench/out"):
        print(f"{r.name}: {r.measured_s:.4f} vs {r.baseline_s:.4f} -> {r.ratio:.2f} "
              f"(target {'>=' if r.higher_is_better else '<='} {r.target}) {'MET' if r.met else 'NOT MET'} {r.notes}")
