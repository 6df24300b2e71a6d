"""Fast commands (the command supervisor, services/sandbox/supervisor.py),
each a ratio against a baseline measured in the same run, p50 with p95 in
the notes:

- `true` through the broker's gRPC Exec (supervised) vs the Docker SDK's
  `exec_run` on the same container: the per-command cost;
- 50 `true` commands in a row through the broker (what a 50-node `run: true`
  chain costs in the sandbox broker; the scheduler's own per-node work is
  in bench_scheduler) per command vs one `exec_run`: target <= 0.05x;
- the same with the supervisor turned off (one exec per command), for
  comparison in the same run;
- a ticket's sandbox created -> first command's output, no pool (cold) vs
  `docker run --rm --network none IMAGE true`; with egress as well;
- THROUGH THE SCHEDULER (real engine, in this process, real brokers):
  ticket created -> first output of its `run:` node, warm (the Workspace's
  `sandbox.pool` filled before each ticket) and cold (a Workspace of the same
  image without a pool), no egress and with egress, p50 with p95, against
  `docker run --rm IMAGE true` measured in the same run; the warm figure is
  the pool's ordinary profile (any ticket of the workflow), not a special
  spare, and the cold one is beside it;
- a 50-node chain of `run: true` through the scheduler: per node (first node
  finished -> last node finished, / 49) vs one Docker SDK `exec_run`.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import subprocess
import time
from pathlib import Path

from bench.bench_sandbox import _exec, bench_broker
from bench.common import Result
from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.sandbox import supervisor
from services.sandbox.dockerapi import DockerAPI
from services.sandbox.images import SANDBOX_IMAGE

ISSUE = 16     # the speed issue ("a warm sandbox ready in a fraction of a `docker run`...")
SAMPLES = 7    # tickets per figure (p50 and p95 of these)
CHAIN = 50


def _p(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _note(ours: list[float], base: list[float]) -> str:
    return (f"p50 {_p(ours, .5) * 1000:.1f} ms / p95 {_p(ours, .95) * 1000:.1f} ms; "
            f"baseline p50 {_p(base, .5) * 1000:.1f} ms / p95 {_p(base, .95) * 1000:.1f} ms")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


CONFIG = """\
kind: Workspace
name: %(name)s
repo: repos/calc.git
baseBranch: main
forge: {type: local}
sandbox:
  image: afe/sandbox:latest
  pool: %(pool)d
%(egress)s
---
kind: Workflow
name: first-%(name)s
workspace: %(name)s
nodes:
  - {id: first, run: "echo go"}
"""


def _scheduler_config(root: Path) -> Path:
    from services.common.demo import make_repo

    cfg = root / "cfg"
    cfg.mkdir(parents=True)   # root/cfg, root/sdata, root/srun
    make_repo(cfg / "repos" / "calc.git")
    docs = [CONFIG % {"name": name, "pool": pool, "egress": "  egress: [bench.invalid]" if egress else ""}
            for name, pool, egress in (("warm", 1, False), ("cold", 0, False), ("warmegress", 1, True),
                                       ("coldegress", 0, True))]
    chain = ['  - {id: n0, run: "true"}'] + [f'  - {{id: n{i}, run: "true", needs: [n{i - 1}]}}'
                                            for i in range(1, CHAIN)]
    docs.append("kind: Workflow\nname: chain\nworkspace: warm\nnodes:\n" + "\n".join(chain) + "\n")
    (cfg / "afe.yaml").write_text("---\n".join(docs))
    return cfg


async def _scheduler_figures(root: Path, docker_run, sdk) -> list[Result]:
    from services._gen.afe.scheduler.v1 import scheduler_pb2 as spb
    from services.common.layout import Layout
    from tests.support.system import afe_system

    layout = Layout(root / "sdata", root / "srun")
    done = {spb.TICKET_STATE_SUCCEEDED, spb.TICKET_STATE_FAILED, spb.TICKET_STATE_CANCELLED}

    async def finished(stub, tid: str) -> object:
        while True:
            t = await stub.GetTicket(spb.GetTicketRequest(id=tid))
            if t.state in done:
                return t
            await asyncio.sleep(0.05)

    async def first_output(sys_, workflow: str) -> float:
        stub = sys_.stub
        t0 = time.time()
        t = await stub.CreateTicket(spb.CreateTicketRequest(workflow=workflow, title="bench"))
        dt = None
        async for ev in stub.WatchTicket(spb.WatchTicketRequest(id=t.id, from_seq=1, follow=True)):
            if ev.type == "node.output":
                dt = ev.at_ms / 1000 - t0
                break
        t = await finished(stub, t.id)
        if t.state != spb.TICKET_STATE_SUCCEEDED or dt is None:
            raise RuntimeError(f"bench ticket failed: {t.error}")
        return dt

    figures: dict[str, list[float]] = {k: [] for k in ("warm", "cold", "warmegress", "coldegress")}
    base: list[float] = []
    async with afe_system(_scheduler_config(root), layout) as sys_:
        pool = sys_.app.engine.pool
        await asyncio.wait_for(pool.filled.wait(), 180)
        await first_output(sys_, "first-cold")                      # the mirror and caches, untimed
        for _ in range(SAMPLES):
            base.append(await asyncio.to_thread(_timed, docker_run))
            for name, samples in figures.items():
                if name.startswith("warm"):
                    await asyncio.wait_for(pool.filled.wait(), 180)    # warm = the pool is filled
                samples.append(await first_output(sys_, f"first-{name}"))
        # the 50-node chain, through the scheduler, on the warm workspace
        per_node = []
        for _ in range(3):
            await asyncio.wait_for(pool.filled.wait(), 180)
            t = await sys_.stub.CreateTicket(spb.CreateTicketRequest(workflow="chain", title="chain"))
            t = await finished(sys_.stub, t.id)
            if t.state != spb.TICKET_STATE_SUCCEEDED:
                raise RuntimeError(f"chain ticket failed: {t.error}")
            per_node.append((t.nodes[-1].finished_at_ms - t.nodes[0].finished_at_ms) / 1000 / (CHAIN - 1))
    s_sdk = []
    for _ in range(21):
        s_sdk.append(await asyncio.to_thread(_timed, sdk))
    med = statistics.median
    out = []
    for name, target, what in (("warm", 0.15, "warm (pool filled)"), ("cold", 0.15, "cold (no pool)"),
                               ("warmegress", 1.0, "with egress, warm (pool filled)"),
                               ("coldegress", 1.0, "with egress, cold (no pool)")):
        out.append(Result(ISSUE, f"ticket created -> first output via the scheduler, {what}",
                          "docker run --rm IMAGE true", med(figures[name]), med(base), target,
                          notes=_note(figures[name], base)))
    out.append(Result(ISSUE, "50-node `run: true` chain through the scheduler, per node",
                      "one Docker SDK exec_run", med(per_node), med(s_sdk), 0.05,
                      notes=f"per node p50 {med(per_node) * 1000:.2f} ms over 3 chains (first node finished -> "
                            f"last finished, / {CHAIN - 1}; includes the command itself); exec_run p50 "
                            f"{med(s_sdk) * 1000:.1f} ms / p95 {_p(s_sdk, .95) * 1000:.1f} ms"))
    return out


def run(out_dir: Path) -> list[Result]:
    results: list[Result] = []
    counter = itertools.count()
    with bench_broker() as (b, client, root):
        stub = b.stub
        ticket = "bench-speed"
        sb = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket))
        container = client.containers.get(sb.container_id)

        def sdk() -> None:
            assert container.exec_run(["true"]).exit_code == 0

        def ours() -> None:
            _exec(stub, ticket, ["true"])

        for _ in range(3):
            sdk()
            ours()
        s_sdk, s_ours = [], []
        for _ in range(41):               # interleaved: load falls on both alike
            s_sdk.append(_timed(sdk))
            s_ours.append(_timed(ours))
        results.append(Result(ISSUE, "Exec `true` via broker gRPC (supervised)", "Docker SDK exec_run",
                              statistics.median(s_ours), statistics.median(s_sdk), 0.05,
                              notes=_note(s_ours, s_sdk)))

        # the supervisor alone (its link from this process, no gRPC): what the stream costs
        async def link_samples() -> list[float]:
            link = await supervisor.Link.start(DockerAPI(), sb.container_id)
            out = []
            try:
                for _ in range(45):
                    t0 = time.perf_counter()
                    c = await link.open(["true"], "/workspace", [], False)
                    while await c.frame() is not None:
                        pass
                    assert await c.exit_code() == 0
                    out.append(time.perf_counter() - t0)
            finally:
                link.close()
            return out[5:]
        s_link = asyncio.run(link_samples())
        results.append(Result(ISSUE, "`true` through the supervisor's stream alone (no gRPC)",
                              "Docker SDK exec_run", statistics.median(s_link), statistics.median(s_sdk),
                              0.05, notes=_note(s_link, s_sdk)))

        chains = []
        for _ in range(5):
            chains.append(_timed(lambda: [ours() for _ in range(50)]) / 50)
        results.append(Result(ISSUE, "50 `true` commands in a row, per command (supervised)",
                              "Docker SDK exec_run", statistics.median(chains), statistics.median(s_sdk),
                              0.05, notes=f"per command p50 {statistics.median(chains) * 1000:.2f} ms "
                                          f"over 5 chains; the scheduler's per-node work is not included"))

        def docker_run() -> None:
            subprocess.run(["docker", "run", "--rm", "--network", "none", SANDBOX_IMAGE, "true"],
                           check=True, stdout=subprocess.DEVNULL)

        def first_output(egress: bool) -> float:
            t = f"bench-first-{next(counter)}"
            t0 = time.perf_counter()
            stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=t, spec=pb.SandboxSpec(
                egress=["bench.invalid"] if egress else [])))
            out = b""
            for ev in stub.Exec(pb.ExecRequest(ticket_id=t, argv=["echo", "hi"])):
                out += ev.stdout
                if out:
                    break
            dt = time.perf_counter() - t0
            stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=t))
            return dt

        docker_run()
        first_output(False)
        base, plain, egress = [], [], []
        for _ in range(7):
            base.append(_timed(docker_run))
            plain.append(first_output(False))
            egress.append(first_output(True))
        results.append(Result(ISSUE, "created -> first command output, cold (no pool)",
                              "docker run --rm --network none", statistics.median(plain),
                              statistics.median(base), 0.15,
                              notes=_note(plain, base) + "; the broker alone (no scheduler): CreateSandbox + Exec"))
        results.append(Result(ISSUE, "created -> first command output with egress, cold (no pool)",
                              "docker run --rm --network none", statistics.median(egress),
                              statistics.median(base), 1.0, notes=_note(egress, base)))
        results += asyncio.run(_scheduler_figures(root / "s", docker_run, sdk))
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
    for r in results:
        print(f"{r.name}: {r.measured_s * 1000:.2f} ms vs {r.baseline_s * 1000:.2f} ms -> {r.ratio:.3f}x "
              f"(target {r.target}x) {'met' if r.met else 'MISSED'}  [{r.notes}]")
    return results


if __name__ == "__main__":
    run(Path("bench/out"))
