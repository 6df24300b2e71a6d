"""Issue 32's "Done when" scenario, run as an operator would see it, and
what was seen (tests/system/test_r37_r45_failover.py judges it).

Two scheduler processes (`sched-a`, `sched-b`) on one real PostgreSQL with
the real sandbox and credential brokers; two tickets:

- `stream`: its `edit` node prints 500 numbered lines, a little apart, each
  tagged with a token its run draws (`<run> line-<i>`), so every stored line
  names the run (the attempt) that printed it, whatever the scheduler's
  events say;
- `push`: its `edit` node prints 500 tagged lines and writes a 24 MiB file,
  so `builtin:open_pr`'s push takes a moment; its `git receive-pack` in the
  forge's repository is caught and held (SIGSTOP) while the database goes
  away, and let go (SIGCONT) once it is down: the push is in flight when the
  database goes.

The database is then stopped for OUTAGE_S (`pg_ctl stop -m fast`, or
SIGKILL of the postmaster: `kill9`) and started again; both tickets are
followed to their end. With `pause_owner`, the scheduler that held
`stream` comes back later than the database (SIGSTOP until the other one
has taken `stream` over): a takeover for certain, and an old owner that
wakes with its lost attempt. `/livez` and `/readyz` of both schedulers are asked
every 0.1 s throughout. The observation (JSON) holds the probes, every
stored event of both tickets, their nodes, the forge's pull requests,
branches and commits, and the schedulers' logs' tails.

The module uses only test helpers that also exist at commit 63decdc (the
code before issue 32), so the positive control runs this same file in an
export of that commit:

    python -m tests.system.failover_scenario --mode stop --out obs.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from tests.scheduler.conftest import STATE, all_events, forge_records, git, write_config
from tests.support import postgres
from tests.support.system import System, afe_system
from tests.support.temp_roots import remove_temp_root, temp_root

try:
    from tests.scheduler.store.test_store_outage import Probes
except ModuleNotFoundError:     # a tree from before tests/scheduler had rooms (the control's 63decdc)
    from tests.scheduler.test_store_outage import Probes  # type: ignore[no-redef]

LINES = 500
OUTAGE_S = 60.0
LEASE_S = 3.0          # short enough that every lease runs out in the outage; see the test's docstring
LINE_SLEEP = 0.04      # `stream` prints a line every 40 ms: 20 s a run

# Each run of `edit` draws its own token; NOTES.md gets one line per run (a re-run on the
# interrupted attempt's files would leave two).
WORKFLOWS = f"""\
kind: Workflow
name: stream
workspace: ws
nodes:
  - id: edit
    run: |
      r=$(od -An -N4 -tx1 /dev/urandom | tr -d ' \\n')
      echo "streamed $r" >> NOTES.md
      for i in $(seq 1 {LINES}); do echo "$r line-$i"; sleep {LINE_SLEEP}; done
  - id: pr
    uses: builtin:open_pr
    needs: [edit]
---
kind: Workflow
name: push
workspace: ws
nodes:
  - id: edit
    run: |
      r=$(od -An -N4 -tx1 /dev/urandom | tr -d ' \\n')
      echo "pushed $r" >> NOTES.md
      head -c 24M /dev/urandom > big.bin
      for i in $(seq 1 {LINES}); do echo "$r line-$i"; sleep 0.002; done
  - id: pr
    uses: builtin:open_pr
    needs: [edit]
"""
DONE = {"succeeded", "failed", "cancelled"}


def _now() -> float:
    return time.monotonic()


# -- the forge's push ------------------------------------------------------------------


def _receive_packs(repo: Path) -> list[int]:
    """Pids of `git receive-pack` processes writing into `repo` (a path unique to this run)."""
    found = []
    needle = str(repo).encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes()
        except OSError:
            continue
        if b"receive-pack" in cmd and needle in cmd:
            found.append(int(entry.name))
    return found


async def _catch_push(repo: Path, deadline_s: float) -> int:
    """Wait for a push into `repo` and hold it (SIGSTOP its receive-pack); its pid."""
    end = _now() + deadline_s
    while _now() < end:
        pids = await asyncio.to_thread(_receive_packs, repo)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                return pid
        await asyncio.sleep(0.01)
    raise RuntimeError(f"no push into {repo} within {deadline_s:.0f} s")


# -- the database ----------------------------------------------------------------------


def _kill9(server: postgres.PgServer) -> None:
    """SIGKILL of the postmaster, its backends left to notice (as tests/support/postgres.py's
    restart_server does, without the start)."""
    data = server.root / "data"
    pid = int((data / "postmaster.pid").read_text().split()[0])
    children = postgres._children(pid)
    os.kill(pid, signal.SIGKILL)
    postgres._wait_gone([pid, *children])
    (data / "postmaster.pid").unlink(missing_ok=True)
    (server.root / f".s.PGSQL.{server.port}.lock").unlink(missing_ok=True)


def _owners(server: postgres.PgServer, db: str) -> dict[str, dict]:
    """Who holds which ticket by the database, read as its administrator."""
    import psycopg

    try:
        with psycopg.connect(server.admin_url(db), autocommit=True) as conn:
            rows = conn.execute("SELECT id, owner, fence FROM tickets").fetchall()
    except Exception as exc:  # noqa: BLE001 - only informative
        return {"error": {"text": str(exc)}}
    return {r[0]: {"owner": r[1], "fence": r[2]} for r in rows}


async def _taken_over(server: postgres.PgServer, db: str, ticket_id: str, old: str, deadline_s: float) -> bool:
    """Wait until another scheduler than `old` holds the ticket by the database."""
    end = _now() + deadline_s
    while _now() < end:
        owner = (await asyncio.to_thread(_owners, server, db)).get(ticket_id, {}).get("owner")
        if owner and owner != old:
            return True
        await asyncio.sleep(0.2)
    return False


# -- the schedulers --------------------------------------------------------------------


async def _second(a: System, root: Path) -> System:
    """`sched-b`: its own socket, data folder and log, the same database and brokers."""
    layout = Layout(root / "b" / "data", root / "b" / "run")
    layout.ensure()
    for service in ("sandbox", "credentials"):
        layout.socket(service).symlink_to(a.layout.socket(service))
    args = [*a.scheduler_args[:-2], "--scheduler-id", "sched-b"]
    b = dataclasses.replace(a, layout=layout, proc=None, app=None, channel=None, stub=None, scheduler_args=args)
    await b.start_scheduler()
    return b


async def _ticket(stubs: list, ticket_id: str) -> pb.Ticket | None:
    for stub in stubs:
        try:
            return await stub.GetTicket(pb.GetTicketRequest(id=ticket_id), timeout=5)
        except grpc.aio.AioRpcError:
            continue
    return None


async def _until_done(stubs: list, ids: list[str], deadline_s: float) -> dict[str, pb.Ticket | None]:
    end = _now() + deadline_s
    last: dict[str, pb.Ticket | None] = dict.fromkeys(ids)
    while _now() < end:
        for tid in ids:
            t = await _ticket(stubs, tid)
            if t is not None:
                last[tid] = t
        if all(t is not None and STATE[t.state] in DONE for t in last.values()):
            break
        await asyncio.sleep(0.3)
    return last


def _line_no(text: str) -> int:
    best = 0
    for line in text.splitlines():
        head, _, num = line.rpartition(" line-")
        if head and num.isdigit():
            best = max(best, int(num))
    return best


async def _follow_progress(stub, ticket_id: str, progress: dict) -> None:
    """The highest line of `ticket_id`'s stream seen so far (live, through `stub`)."""
    with contextlib.suppress(grpc.aio.AioRpcError):
        async for ev in stub.WatchTicket(pb.WatchTicketRequest(id=ticket_id, from_seq=1, follow=True)):
            if ev.type == "node.output":
                progress[ticket_id] = max(progress.get(ticket_id, 0), _line_no(json.loads(ev.payload_json)["text"]))


def _event(ev) -> dict:
    return {"seq": ev.seq, "type": ev.type, "payload": json.loads(ev.payload_json or "{}"), "at_ms": ev.at_ms}


def _branches(bare: Path, ticket_id: str) -> dict:
    """The ticket's branches in the forge's repository and, for its branch, every commit above
    the base with the lines it adds to NOTES.md and the files it touches."""
    refs = [r for r in git(bare, "for-each-ref", "--format=%(refname)", "refs/heads/").split() if ticket_id in r]
    out: dict = {"refs": refs, "commits": []}
    branch = f"refs/heads/afe/{ticket_id}"
    if branch not in refs:
        return out
    out["tip"] = git(bare, "rev-parse", branch).strip()
    for sha in git(bare, "rev-list", "--reverse", f"main..{branch}").split():
        files = [f for f in git(bare, "diff-tree", "--no-commit-id", "--name-only", "-r", sha).split() if f]
        patch = git(bare, "show", "--format=", sha, "--", "NOTES.md")
        added = [ln[1:] for ln in patch.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
        patch_id = subprocess.run(["git", "--git-dir", str(bare), "patch-id", "--stable"],
                                  input=git(bare, "show", sha), capture_output=True, text=True,
                                  check=False).stdout.split()[:1]
        out["commits"].append({"sha": sha, "subject": git(bare, "log", "-1", "--format=%s", sha).strip(),
                               "files": files, "notes_added": added, "patch_id": patch_id[0] if patch_id else ""})
    diff = git(bare, "diff", f"main...{branch}", "--", "NOTES.md")
    out["notes_added"] = [ln[1:] for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return out


def _catches(pid: int, sig: int) -> bool:
    """The process handles `sig` (an older afe, the control's, would be ended by SIGUSR1)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) >> (sig - 1) & 1)


def _tail(path: Path | None, n: int = 20000) -> str:
    if path is None or not path.exists():
        return ""
    return path.read_text(errors="replace")[-n:]


async def run(mode: str, outage_s: float = OUTAGE_S, lease_s: float = LEASE_S, settle_s: float = 180,
              pause_owner: bool = False) -> dict:
    """The scenario; returns the observation (JSON-able). `settle_s`: how long both tickets get to
    end once the database is back (a ticket still live then is reported as it is). `pause_owner`:
    the scheduler that held `stream` is paused (SIGSTOP) from just before the database starts
    again until the other one has taken `stream` over (at most 30 s), as a scheduler that comes
    back slower than the database does: a takeover happens for certain, and the old owner wakes
    with its lost attempt."""
    if mode not in ("stop", "kill9"):
        raise ValueError(f"mode {mode!r}: stop or kill9")
    root = temp_root("afe-fo-")
    server = postgres.start_server(durable=True)
    obs: dict = {"mode": mode, "outage_s": outage_s, "lease_s": lease_s, "lines": LINES, "t": {}}
    t = obs["t"]
    try:
        db = server.fresh_database()
        cfg = write_config(root, WORKFLOWS)
        bare = cfg / "repos" / "calc.git"
        layout = Layout(root / "data", root / "run")
        args = ["--lease-seconds", f"{lease_s:g}", "--scheduler-id", "sched-a"]
        async with afe_system(cfg, layout, subprocess=True, database_url=server.app_url(db),
                              scheduler_args=args) as a:
            b = await _second(a, root)
            stubs = [a.stub, b.stub]
            progress: dict[str, int] = {}
            follower: asyncio.Task | None = None
            try:
                with Probes(a.ready["ops_port"]) as probes_a, Probes(b.ready["ops_port"]) as probes_b:
                    t["created"] = _now()
                    stream = await a.stub.CreateTicket(pb.CreateTicketRequest(workflow="stream", title="stream",
                                                                              principal="tester"))
                    push = await b.stub.CreateTicket(pb.CreateTicketRequest(workflow="push", title="push",
                                                                            principal="tester"))
                    obs["ids"] = {"stream": stream.id, "push": push.id}
                    follower = asyncio.create_task(_follow_progress(b.stub, stream.id, progress))

                    held = await _catch_push(bare, 240)
                    t["push_held"] = _now()
                    obs["stream_line_at_stop"] = progress.get(stream.id, 0)
                    obs["owners_before"] = await asyncio.to_thread(_owners, server, db)
                    t["stop"] = _now()
                    obs["stop_wall_ms"] = time.time_ns() // 1_000_000     # the events' clock (the judge's)
                    try:
                        await asyncio.to_thread(postgres.stop_only if mode == "stop" else _kill9, server)
                        t["down"] = _now()
                    finally:
                        obs["push_alive_at_down"] = Path(f"/proc/{held}").exists()
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(held, signal.SIGCONT)
                    await asyncio.sleep(max(0.0, t["stop"] + outage_s - _now()))
                    paused = None
                    if pause_owner:
                        name = obs["owners_before"].get(stream.id, {}).get("owner", "")
                        paused = {"sched-a": a, "sched-b": b}.get(name)
                        if paused is not None and paused.proc is not None:
                            os.kill(paused.proc.pid, signal.SIGSTOP)
                            obs["paused"] = {"scheduler": name, "from": _now()}
                    try:
                        await asyncio.to_thread(postgres.start_again, server)
                        t["up"] = _now()
                        if "paused" in obs:
                            obs["paused"]["taken_over"] = await _taken_over(server, db, stream.id,
                                                                            obs["paused"]["scheduler"], 30)
                    finally:
                        if "paused" in obs and paused is not None and paused.proc is not None:
                            os.kill(paused.proc.pid, signal.SIGCONT)
                            obs["paused"]["to"] = _now()

                    final = await _until_done(stubs, [stream.id, push.id], settle_s)
                    t["done"] = _now()
                    for _ in range(150):     # both answer ready again (the probes' record shows when)
                        if all(any(at > t["up"] and st == 200 for at, st, _f in p.readyz)
                               for p in (probes_a, probes_b)):
                            break
                        await asyncio.sleep(0.2)
                    for sched, p in ((a, probes_a), (b, probes_b)):
                        if (sched.proc is not None and _catches(sched.proc.pid, signal.SIGUSR1)
                                and not any(at > t["up"] and st == 200 for at, st, _f in p.readyz)):
                            # still not ready: where its threads wait goes into its log (kill -USR1)
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(sched.proc.pid, signal.SIGUSR1)
                            await asyncio.sleep(0.5)
                obs["probes"] = {name: {"livez": p.livez, "readyz": p.readyz}
                                 for name, p in (("sched-a", probes_a), ("sched-b", probes_b))}
                obs["owners_after"] = await asyncio.to_thread(_owners, server, db)
                obs["tickets"] = {}
                for name, tid in obs["ids"].items():
                    tk = final[tid]
                    obs["tickets"][name] = {
                        "id": tid,
                        "state": STATE[tk.state] if tk is not None else "unknown",
                        "error": tk.error if tk is not None else "no answer",
                        "nodes": [{"id": n.id, "state": n.state, "attempt": n.attempt} for n in tk.nodes]
                        if tk is not None else [],
                        "events": [_event(e) for e in await all_events(b.stub, tid)],
                        "prs": forge_records(layout.data_dir, tid),
                        "forge": _branches(bare, tid),
                    }
            finally:
                if follower is not None:
                    follower.cancel()
                    await asyncio.gather(follower, return_exceptions=True)
                await b.stop_scheduler()
                obs["logs"] = {"sched-a": _tail(a.log_path), "sched-b": _tail(b.log_path)}
    finally:
        postgres.stop_server(server)
        remove_temp_root(root)
    return obs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="stop", choices=("stop", "kill9"))
    p.add_argument("--outage", type=float, default=OUTAGE_S)
    p.add_argument("--lease", type=float, default=LEASE_S)
    p.add_argument("--settle", type=float, default=180, help="seconds the tickets get to end after the outage")
    p.add_argument("--pause-owner", action="store_true", help="pause stream's owner until the other takes it over")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    obs = asyncio.run(run(a.mode, a.outage, a.lease, a.settle, a.pause_owner))
    Path(a.out).write_text(json.dumps(obs))


if __name__ == "__main__":
    main()
