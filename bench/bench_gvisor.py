"""gVisor sandboxes (issue 23) beside runc ones, each a ratio against a
baseline measured in the same run (interleaved, medians):

- sandbox ready (CreateSandbox + first Exec) under gVisor vs `docker run
  --rm --runtime=runsc --network none IMAGE true`, and vs runc's `docker run`;
- the same with an egress allowlist (its proxy reached through the socket);
- ticket -> first output: cold (a new sandbox, then `echo`) and warm (a
  sandbox made ahead, as the pool keeps one: `echo` alone), vs docker run;
- per-node overhead: Exec `true` through the broker vs the Docker SDK exec
  on the same gVisor container;
- egress ready for runc over its socket (`--egress-transport socket`) vs over
  the ticket's internal network (the ADR's measurement).

Without runsc registered with the engine, it reports nothing (and says why).
"""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import time
from pathlib import Path

import docker

from bench.bench_sandbox import _exec, bench_broker
from bench.common import Result, median_time
from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.common.host.images import SANDBOX_IMAGE, ensure_images

ISSUE = 23
ROUNDS = 7
# the Docker CLI gets an environment of its own: PATH, and the engine's address when one is set (R33)
_DOCKER_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin",
               **{k: os.environ[k] for k in ("DOCKER_HOST", "HOME") if k in os.environ}}


def _docker_run(runtime: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(["docker", "run", "--rm", f"--runtime={runtime}", "--network", "none", SANDBOX_IMAGE, "true"],
                   check=True, stdout=subprocess.DEVNULL, env=_DOCKER_ENV)
    return time.perf_counter() - t0


def _first_output(stub, ticket: str) -> None:
    for ev in stub.Exec(pb.ExecRequest(ticket_id=ticket, argv=["echo", "first"])):
        if ev.WhichOneof("event") == "stdout":
            return
    raise AssertionError("no output")


def _ready(stub, counter, runtime: str, egress: bool, then=_exec) -> float:
    ticket = f"bench-gv-{next(counter)}"
    t0 = time.perf_counter()
    stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(
        egress=["bench.invalid"] if egress else [], runtime="" if runtime == "runc" else runtime)))
    if then is _exec:
        _exec(stub, ticket, ["true"])
    else:
        then(stub, ticket)
    dt = time.perf_counter() - t0
    stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
    return dt


def run(out_dir: Path) -> list[Result]:
    ensure_images(progress=lambda _m: None)
    if "runsc" not in (docker.from_env().info().get("Runtimes") or {}):
        print("gVisor: the engine has no runsc runtime (scripts/ensure_runsc.sh registers it): no rows")
        return []
    results: list[Result] = []
    counter = itertools.count()
    with bench_broker() as (b, client, _root):
        stub = b.stub
        _ready(stub, counter, "gvisor", False)              # warm-up: images, first runsc start
        s: dict[str, list[float]] = {k: [] for k in ("runc_run", "gv_run", "gv", "gv_egress", "cold")}
        for _ in range(ROUNDS):
            s["runc_run"].append(_docker_run("runc"))
            s["gv_run"].append(_docker_run("runsc"))
            s["gv"].append(_ready(stub, counter, "gvisor", False))
            s["gv_egress"].append(_ready(stub, counter, "gvisor", True))
            s["cold"].append(_ready(stub, counter, "gvisor", False, then=_first_output))
        m = {k: statistics.median(v) for k, v in s.items()}
        results += [
            Result(ISSUE, "gVisor sandbox ready (create + first exec)", "docker run --runtime=runsc", m["gv"],
                   m["gv_run"], 1.3),
            Result(ISSUE, "gVisor sandbox ready, beside runc's docker run", "docker run (runc)", m["gv"],
                   m["runc_run"], None),
            Result(ISSUE, "gVisor egress ready (proxy through its socket)", "docker run --runtime=runsc",
                   m["gv_egress"], m["gv_run"], 2.5),
            Result(ISSUE, "gVisor ticket -> first output, cold (new sandbox)", "docker run --runtime=runsc",
                   m["cold"], m["gv_run"], None),
        ]
        ticket = "bench-gv-warm"
        sb = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(runtime="gvisor")))
        warm = median_time(lambda: _first_output(stub, ticket), repeat=15, warmup=2)
        results.append(Result(ISSUE, "gVisor ticket -> first output, warm (sandbox made ahead)",
                              "docker run --runtime=runsc", warm, m["gv_run"], None))

        def sdk_exec() -> None:
            e = client.api.exec_create(sb.container_id, ["true"])
            client.api.exec_start(e["Id"])
            assert client.api.exec_inspect(e["Id"])["ExitCode"] == 0

        ours = median_time(lambda: _exec(stub, ticket, ["true"]), repeat=15, warmup=2)
        sdk = median_time(sdk_exec, repeat=15, warmup=2)
        results.append(Result(ISSUE, "gVisor per-node overhead: Exec `true` via broker", "Docker SDK exec directly",
                              ours, sdk, 1.3))
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
        network = [_ready(stub, counter, "runc", True) for _ in range(ROUNDS)]
    with bench_broker(("--egress-transport", "socket")) as (b2, _client, _root):
        _ready(b2.stub, counter, "runc", True)
        sock = [_ready(b2.stub, counter, "runc", True) for _ in range(ROUNDS)]
    results.append(Result(ISSUE, "runc egress ready through the proxy's socket", "through the ticket network",
                          statistics.median(sock), statistics.median(network), None))
    for r in results:
        print(f"{r.name}: {r.measured_s * 1000:.1f} ms vs {r.baseline} {r.baseline_s * 1000:.1f} ms -> "
              f"{r.ratio:.2f}x" + (f" (target {r.target}x) {'met' if r.met else 'MISSED'}" if r.target else ""))
    return results


if __name__ == "__main__":
    run(Path("bench/out"))
