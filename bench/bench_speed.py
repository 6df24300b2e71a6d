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
  `docker run --rm --network none IMAGE true`; with egress as well.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import statistics
import subprocess
import time
from pathlib import Path

import docker

from bench.bench_sandbox import _Broker, _exec
from bench.common import Result
from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.sandbox import supervisor
from services.sandbox.dockerapi import DockerAPI
from services.sandbox.images import SANDBOX_IMAGE, ensure_images
from tests.support.temp_roots import remove_temp_root, temp_root

ISSUE = 0      # the speed issue ("a warm sandbox ..., a command in a few milliseconds")


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


def run(out_dir: Path) -> list[Result]:
    ensure_images(progress=lambda _m: None)
    client = docker.from_env()
    instance = "bench" + secrets.token_hex(4)
    root = temp_root("afe-bench-")
    results: list[Result] = []
    counter = itertools.count()
    net = client.networks.create(f"afe-bench-{instance}", labels={"afe.instance": instance})
    net.reload()
    subnet = net.attrs["IPAM"]["Config"][0]["Subnet"]
    try:
        with _Broker(root, instance, egress_network=net.name, allow_private=subnet) as b:
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
                                  notes=_note(plain, base) + "; no warm pool yet: the target is for a warm one"))
            results.append(Result(ISSUE, "created -> first command output with egress, cold (no pool)",
                                  "docker run --rm --network none", statistics.median(egress),
                                  statistics.median(base), 1.0, notes=_note(egress, base)))
            stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
    finally:
        net.remove()
        remove_temp_root(root)
    for r in results:
        print(f"{r.name}: {r.measured_s * 1000:.2f} ms vs {r.baseline_s * 1000:.2f} ms -> {r.ratio:.3f}x "
              f"(target {r.target}x) {'met' if r.met else 'MISSED'}  [{r.notes}]")
    return results


if __name__ == "__main__":
    run(Path("bench/out"))
