"""Load (the speed issue, item 5): 50 tickets x 10 nodes created at once
through a real `afe up` (the four processes) and its gateway's /rpc.

The workflow fans out and back in: `a` -> `b1`..`b8` -> `z`, every node a
`run:` command. Each ticket is created on its own /rpc WebSocket (bearer
token) and watched there from seq 1 (`tickets.watch`), all at once. Measured:

- nodes/s over the whole load (500 nodes / first create -> last ticket
  finished), as a ratio against one ticket of the same workflow alone on the
  same afe right before (its nodes / its duration): target >= 1.0, i.e. 50
  tickets at once get at least the throughput of one;
- p50/p95 ticket duration (created -> `ticket.finished`, queueing included)
  and the time queued under the global capacity limit (`--max-running`);
- peak RSS (VmHWM at the end, and VmRSS polled for the chart) of the
  scheduler, the sandbox broker and the other two processes;
- correctness, which fails the module when violated: every ticket succeeded,
  every watcher's seqs are exactly 1..N (no gap, no duplicate) ending with
  `ticket.finished`, every node finished once, and after every ticket ended
  and `afe up` stopped no Docker container, network or volume labelled with
  the run's `afe.instance` is left.

Bounded: a deadline on the whole load (DEADLINE_S), after which the open
watches are dropped and the module reports what did not finish.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from bench.common import Result, Section

ISSUE = 16          # the speed issue (item 5: the load benchmark)
TICKETS = 50
FAN = 8             # a -> b1..b8 -> z: 10 nodes
MAX_RUNNING = 8     # afe up --max-running: tickets running at once (the rest queue); afe's default is 4
DEADLINE_S = 420.0
ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("scheduler", "sandbox", "gateway", "credentials")

CONFIG = """\
kind: Workspace
name: ws
repo: repos/calc.git
baseBranch: main
forge: {type: local}
---
kind: Workflow
name: fan
workspace: ws
nodes:
%s
"""


def workflow_nodes(fan: int = FAN) -> list[str]:
    nodes = ['  - {id: a, run: "echo a"}']
    nodes += [f'  - {{id: b{i}, run: "echo b{i}", needs: [a]}}' for i in range(1, fan + 1)]
    nodes.append(f'  - {{id: z, run: "echo z", needs: [{", ".join(f"b{i}" for i in range(1, fan + 1))}]}}')
    return nodes


def _p(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


def check_sequence(seqs: list[int]) -> str | None:
    """None when `seqs` is exactly 1..N; else what is wrong (gaps, duplicates, order)."""
    if not seqs:
        return "no events"
    dup = len(seqs) - len(set(seqs))
    missing = sorted(set(range(1, max(seqs) + 1)) - set(seqs))
    problems = []
    if dup:
        problems.append(f"{dup} duplicated")
    if missing:
        problems.append(f"missing seq {missing[:5]}{'...' if len(missing) > 5 else ''}")
    if not dup and not missing and seqs != sorted(seqs):
        problems.append("out of order")
    if seqs[0] != 1 and not missing:
        problems.append(f"starts at {seqs[0]}")
    return ", ".join(problems) or None


@dataclass
class Watched:
    ticket_id: str = ""
    events: list[dict] = field(default_factory=list)
    created_s: float = 0.0          # bench clock, the create request sent
    finished_s: float = 0.0         # bench clock, ticket.finished received
    state: str = ""
    error: str = ""

    def at(self, type_: str) -> float | None:
        for ev in self.events:
            if ev["type"] == type_:
                return ev["at_ms"] / 1000
        return None

    def started(self) -> float | None:
        """When the ticket left the queue: its first `ticket.state` -> running."""
        for ev in self.events:
            if ev["type"] == "ticket.state" and ev["payload"].get("state") == "running":
                return ev["at_ms"] / 1000
        return self.at("node.started")

    @property
    def duration(self) -> float:
        """created -> ticket.finished, both from the scheduler's own event times."""
        return self.events[-1]["at_ms"] / 1000 - self.events[0]["at_ms"] / 1000


# -- afe up -------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AfeUp:
    def __init__(self, base: Path, config: Path, max_running: int) -> None:
        self.base = base
        self.instance = f"bload-{secrets.token_hex(4)}"
        self.port = _free_port()
        env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
        env["TZ"] = "UTC"
        argv = [sys.executable, "-m", "services.cli.main", "up", "--config", str(config),
                "--data", str(base / "data"), "--run", str(base / "run"), "--ops-port", "0",
                "--listen", f"127.0.0.1:{self.port}", "--instance", self.instance, "--no-images",
                "--max-running", str(max_running)]
        self.output: list[str] = []
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, b""):
            self.output.append(line.decode("utf-8", "replace"))

    def state(self) -> dict | None:
        try:
            return json.loads((self.base / "run" / "launcher.json").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def wait_up(self, timeout: float = 150.0) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.state()
            if st and st["children"] and all(c["ready"] for c in st["children"].values()):
                return {k: v["pid"] for k, v in st["children"].items()}
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"afe up did not become ready:\n{''.join(self.output)[-3000:]}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def token(self) -> str:
        return (self.base / "data" / "ui-token").read_text().strip()

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def docker_leftovers(instance: str) -> dict[str, list[str]]:
    import docker

    client = docker.from_env()
    try:
        flt = {"label": f"afe.instance={instance}"}
        return {"containers": [c.name for c in client.containers.list(all=True, filters=flt)],
                "networks": [n.name for n in client.networks.list(filters=flt)],
                "volumes": [v.name for v in client.volumes.list(filters=flt)]}
    finally:
        client.close()


# -- /proc ----------------------------------------------------------------------

def status_kib(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class RssSampler:
    """VmRSS of each process every `every` seconds, in a thread (off the bench's event loop)."""

    def __init__(self, pids: dict[str, int], every: float = 0.25) -> None:
        self.pids = pids
        self.every = every
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            row = {k: status_kib(p, "VmRSS") for k, p in self.pids.items()}
            self.samples.append((time.perf_counter(), {k: v for k, v in row.items() if v is not None}))
            self._stop.wait(self.every)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def peak(self, name: str) -> int:
        return max((row.get(name, 0) for _t, row in self.samples), default=0)


# -- /rpc -------------------------------------------------------------------------

async def one_ticket(url: str, token: str, workflow: str, title: str, t0: float) -> Watched:
    """Create one ticket on its own /rpc WebSocket and watch it from seq 1 to its end."""
    import aiohttp

    w = Watched()
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session, \
            session.ws_connect(url.replace("http", "ws", 1) + "/rpc", max_msg_size=32 * 1024 * 1024,
                               headers={"Authorization": f"Bearer {token}"}) as ws:
        async def call(rid: int, method: str, params: dict) -> dict:
            await ws.send_str(json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params}))
            while True:
                doc = json.loads((await ws.receive()).data)
                if doc.get("id") == rid:
                    if "error" in doc:
                        raise RuntimeError(f"{method}: {doc['error'].get('message')}")
                    return doc["result"]

        w.created_s = time.perf_counter() - t0
        created = await call(1, "tickets.create", {"workflow": workflow, "title": title})
        w.ticket_id = created["id"]
        sub = (await call(2, "tickets.watch", {"id": w.ticket_id, "from_seq": 1, "follow": True}))["subscription"]
        while True:
            msg = await ws.receive()
            if msg.type != aiohttp.WSMsgType.TEXT:
                w.error = f"the gateway closed the watch ({msg.type.name})"
                break
            doc = json.loads(msg.data)
            params = doc.get("params") or {}
            if params.get("subscription") != sub:
                continue
            if doc.get("method") == "tickets.watch_end":
                if params.get("error"):
                    w.error = str(params["error"].get("message"))
                break
            w.events.append(params["event"])
            if params["event"]["type"] == "ticket.finished":
                w.finished_s = time.perf_counter() - t0
        w.state = (await call(3, "tickets.get", {"id": w.ticket_id}))["state"]
    return w


def verify(watched: list[Watched], nodes_per_ticket: int) -> list[str]:
    """What is wrong with the tickets' event streams (empty when all is well)."""
    problems = []
    ids = [w.ticket_id for w in watched]
    if len(set(ids)) != len(ids):
        problems.append("two creates answered the same ticket id")
    for w in watched:
        where = f"ticket {w.ticket_id or '?'}"
        if w.error:
            problems.append(f"{where}: {w.error}")
        if w.state != "succeeded":
            problems.append(f"{where}: ended {w.state or 'unknown'}, not succeeded")
        seq_problem = check_sequence([e["seq"] for e in w.events])
        if seq_problem:
            problems.append(f"{where}: events {seq_problem}")
        if not w.events or w.events[-1]["type"] != "ticket.finished":
            problems.append(f"{where}: its watch did not end with ticket.finished")
        if any(e["ticket_id"] != w.ticket_id for e in w.events):
            problems.append(f"{where}: another ticket's event on its watch")
        finished = [e["payload"].get("node") for e in w.events if e["type"] == "node.finished"]
        if sorted(finished) != sorted(set(finished)) or len(finished) != nodes_per_ticket:
            problems.append(f"{where}: {len(finished)} node.finished events for {len(set(finished))} of "
                            f"{nodes_per_ticket} nodes")
    return problems


# -- the chart -------------------------------------------------------------------------

def write_chart(watched: list[Watched], rss: RssSampler, t0: float, path: Path, max_running: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 8), gridspec_kw={"height_ratios": [3, 2]})
    order = sorted(watched, key=lambda w: w.events[0]["at_ms"] if w.events else 0)
    base_ms = min((w.events[0]["at_ms"] for w in order if w.events), default=0)
    for y, w in enumerate(order):
        if not w.events:
            continue
        start = (w.events[0]["at_ms"] - base_ms) / 1000
        run = w.started()
        end = (w.events[-1]["at_ms"] - base_ms) / 1000
        began = (run * 1000 - base_ms) / 1000 if run is not None else start
        ax1.barh(y, began - start, left=start, color="#bdbdbd", height=0.8)
        ax1.barh(y, end - began, left=began, color="#2e7d32" if w.state == "succeeded" else "#c62828",
                 height=0.8)
    ax1.set_ylabel("ticket (by creation)")
    ax1.set_xlabel("seconds since the first ticket was created")
    ax1.set_title(f"{len(watched)} tickets x {FAN + 2} nodes at once (grey: queued, max-running "
                  f"{max_running}; green: running)")
    ax1.invert_yaxis()
    for name in SERVICES:
        pts = [(t - t0, row[name] / 1024) for t, row in rss.samples if name in row]
        if pts:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], label=name)
    ax2.set_xlabel("seconds since the tickets were sent")
    ax2.set_ylabel("RSS (MiB)")
    ax2.legend(loc="upper left")
    ax2.set_title("resident memory of afe's processes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- the run -------------------------------------------------------------------------

async def _load(afe: AfeUp, pids: dict[str, int], out_dir: Path) -> tuple[list[Result], Section]:
    url, token = afe.url, afe.token()
    nodes_per = FAN + 2
    # The same workflow alone: a first ticket warms the mirror, the second is the baseline.
    await one_ticket(url, token, "fan", "warm-up", time.perf_counter())
    alone = await one_ticket(url, token, "fan", "alone", time.perf_counter())
    alone_problems = verify([alone], nodes_per)
    if alone_problems:
        raise RuntimeError("the single ticket before the load failed: " + "; ".join(alone_problems))

    t0 = time.perf_counter()
    with RssSampler(pids) as rss:
        tasks = [asyncio.create_task(one_ticket(url, token, "fan", f"load {i}", t0)) for i in range(TICKETS)]
        _done, pending = await asyncio.wait(tasks, timeout=DEADLINE_S)
        wall = time.perf_counter() - t0
        for t in pending:
            t.cancel()
        hwm = {k: status_kib(p, "VmHWM") or 0 for k, p in pids.items()}
    watched, problems = [], []
    for t in tasks:
        if t in pending:
            problems.append(f"a ticket did not finish within {DEADLINE_S:.0f} s")
        elif t.exception() is not None:
            problems.append(f"a ticket's create/watch failed: {t.exception()}")
        else:
            watched.append(t.result())
    problems += verify(watched, nodes_per)
    ok = [w for w in watched if w.state == "succeeded" and w.events]
    last_finish = max((w.finished_s for w in ok), default=wall)
    nodes_s = len(ok) * nodes_per / last_finish if ok else 0.0
    alone_nodes_s = nodes_per / alone.duration
    durations = [w.duration for w in ok]
    queued = [(w.started() or w.events[0]["at_ms"] / 1000) - w.events[0]["at_ms"] / 1000 for w in ok]
    running = [d - q for d, q in zip(durations, queued, strict=True)]
    events = sum(len(w.events) for w in watched)
    chart = write_chart(watched, rss, t0, out_dir / "load.png", MAX_RUNNING)

    mib = lambda kib: f"{kib / 1024:.0f} MiB"
    rows = [
        ("tickets at once / nodes each", f"{TICKETS} / {nodes_per} (a → b1..b{FAN} → z, all `run:`)"),
        ("global capacity (`afe up --max-running`)", f"{MAX_RUNNING} tickets running at once; the rest queue"),
        ("tickets succeeded", f"{len(ok)} of {TICKETS}"),
        ("nodes/s (all tickets: first create → last finished)", (f"{nodes_s:.1f} ({len(ok) * nodes_per} nodes "
                                                                  f"in {last_finish:.1f} s)")),
        ("nodes/s of one ticket alone (same afe, before the load)", (f"{alone_nodes_s:.1f} "
                                                                      f"({alone.duration:.2f} s per ticket)")),
        ("ticket duration p50 / p95 (created → finished)", f"{_p(durations, .5):.1f} s / {_p(durations, .95):.1f} s"),
        ("of which queued p50 / p95", f"{_p(queued, .5):.1f} s / {_p(queued, .95):.1f} s"),
        ("running p50 / p95 (state running → finished)", f"{_p(running, .5):.1f} s / {_p(running, .95):.1f} s"),
        (f"events watched ({TICKETS} watchers over /rpc)", (f"{events}; gap-free and duplicate-free: "
                                                   f"{'yes' if not any('events' in p for p in problems) else 'no'}")),
    ]
    rows += [(f"peak RSS, {name} (VmHWM; polled VmRSS peak)", f"{mib(hwm.get(name, 0))}; {mib(rss.peak(name))}")
             for name in SERVICES]
    body = ["| measurement | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    results = [Result(ISSUE, f"load: nodes/s, {TICKETS} tickets x {nodes_per} nodes at once via the gateway",
                      "one ticket of the same workflow alone (nodes/s)", nodes_s, alone_nodes_s, 1.0,
                      higher_is_better=True,
                      notes=(f"max-running {MAX_RUNNING}; p50/p95 ticket {_p(durations, .5):.1f}/"
                             f"{_p(durations, .95):.1f} s; peak RSS scheduler {mib(hwm.get('scheduler', 0))}, "
                             f"sandbox broker {mib(hwm.get('sandbox', 0))}"))]
    section = Section(title=f"Load: {TICKETS} tickets x {nodes_per} nodes at once (bench_load)",
                      body="\n".join(body), images=(chart.name,), problems=tuple(problems))
    return results, section


def run(out_dir: Path) -> list[Result | Section]:
    from services.common.demo import make_repo
    from services.common.host.images import ensure_images
    from tests.support.temp_roots import remove_temp_root, temp_root

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ensure_images(progress=lambda _m: None)
    root = temp_root("afe-bl-")
    try:
        cfg = root / "cfg"
        make_repo(cfg / "repos" / "calc.git")
        (cfg / "afe.yaml").write_text(CONFIG % "\n".join(workflow_nodes()))
        afe = AfeUp(root, cfg, MAX_RUNNING)
        try:
            pids = afe.wait_up()
            results, section = asyncio.run(_load(afe, pids, out_dir))
        finally:
            rc = afe.stop()
        problems = list(section.problems)
        if rc not in (0, -signal.SIGTERM):
            problems.append(f"afe up exited with {rc} on SIGTERM")
        left = docker_leftovers(afe.instance)
        n_left = sum(len(v) for v in left.values())
        if n_left:
            problems.append(f"Docker objects labelled afe.instance={afe.instance} left after afe stopped: {left}")
        body = section.body + (f"\n| Docker objects left after `afe up` stopped (label afe.instance) | "
                               f"{n_left} ({', '.join(f'{len(v)} {k}' for k, v in left.items())}) |")
        return [*results, Section(section.title, body, section.images, tuple(problems))]
    finally:
        remove_temp_root(root)


if __name__ == "__main__":
    for item in run(ROOT / "bench" / "out"):
        print(item)
