"""Sandbox broker benchmarks (issue 3), each a ratio against a baseline
measured in the same run:

- sandbox ready (CreateSandbox + first Exec of `true`, over gRPC) vs
  `docker run --rm --network none IMAGE true`: <= 1.3x; with egress <= 2.5x;
- Exec of `true` through the broker's gRPC vs the Docker SDK exec directly:
  <= 1.15x;
- a 4 KiB file read / write through the file tools vs `docker exec cat` /
  `docker exec tee`: <= 0.1x.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import grpc

from bench.common import Result, median_time
from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services._gen.afe.sandbox.v1 import sandbox_pb2_grpc
from services.common.host.images import SANDBOX_IMAGE, ensure_images
from services.common.layout import Layout
from services.common.rpc.grpcutil import _LinkAuth, socket_target
from services.common.rpc.links import LinkSecrets, new_secret, pass_via_pipe
from tests.support.temp_roots import remove_temp_root, temp_root

ISSUE = 3
REPO = Path(__file__).resolve().parents[1]


CONFIG = """kind: Workspace
name: bench
repo: /nonexistent/bench.git
---
kind: Workflow
name: bench
workspace: bench
nodes:
  - id: run
    run: "true"
"""


class _Broker:
    """The real broker process (`python -m services.sandbox.main`), as in production;
    `module`: another entry point that runs it (bench/proxy_before.py)."""

    def __init__(self, root: Path, instance: str, *, egress_network: str, allow_private: str,
                 extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 module: str = "services.sandbox.main") -> None:
        self.root = root
        self.module = module
        self.extra = extra
        self.env = dict(env or {})
        self.layout = Layout(root / "data", root / "run")
        self.instance = instance
        self.egress_network = egress_network
        self.allow_private = allow_private
        self.secret = new_secret()
        self.socket = str(self.layout.socket("sandbox"))

    def __enter__(self):
        (self.root / "cfg").mkdir(parents=True)
        (self.root / "cfg" / "afe.yaml").write_text(CONFIG)
        link_fd = pass_via_pipe(LinkSecrets(serve={"scheduler": self.secret}).to_json())
        status_r, status_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, "--config", str(self.root / "cfg"),
             "--data", str(self.layout.data_dir), "--run", str(self.layout.run_dir), "--link-fd", str(link_fd),
             "--status-fd", str(status_w), "--ops-port", "0", "--instance", self.instance,
             "--egress-network", self.egress_network, "--allow-private", self.allow_private,
             "--log-level", "WARNING", *self.extra],
            cwd=REPO, env={"PATH": os.environ["PATH"], "HOME": str(self.root), **self.env},
            pass_fds=(link_fd, status_w))
        os.close(link_fd)
        os.close(status_w)
        with os.fdopen(status_r) as f:
            if not f.readline():
                raise RuntimeError("the sandbox broker exited before it was ready")
        creds = grpc.composite_channel_credentials(grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
                                                   grpc.metadata_call_credentials(_LinkAuth(self.secret)))
        self.channel = grpc.secure_channel(socket_target(self.socket), creds)
        self.stub = sandbox_pb2_grpc.SandboxBrokerStub(self.channel)
        return self

    def __exit__(self, *exc):
        try:
            self.stub.Reconcile(pb.ReconcileRequest(live_tickets=[]))
        finally:
            self.channel.close()
            self.proc.terminate()
            self.proc.wait(30)


def _exec(stub, ticket: str, argv: list[str]) -> int:
    code = None
    for ev in stub.Exec(pb.ExecRequest(ticket_id=ticket, argv=argv)):
        if ev.WhichOneof("event") == "exit":
            code = ev.exit.code
    assert code == 0, code
    return code


@contextlib.contextmanager
def bench_broker(extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 module: str = "services.sandbox.main") -> Iterator[tuple[_Broker, docker.DockerClient, Path]]:
    """A real sandbox broker with an egress network and a temp root of its
    own (the images built first); network and root are removed afterwards.
    `extra`: more flags of the broker (--egress-transport socket); `env`: more
    of its environment (AFE_CA_FILE); `module`: its entry point."""
    ensure_images(progress=lambda _m: None)
    client = docker.from_env()
    instance = "bench" + secrets.token_hex(4)
    root = temp_root("afe-bench-")
    net = client.networks.create(f"afe-bench-{instance}", labels={"afe.instance": instance})
    net.reload()
    subnet = net.attrs["IPAM"]["Config"][0]["Subnet"]
    try:
        with _Broker(root, instance, egress_network=net.name, allow_private=subnet, extra=extra, env=env,
                     module=module) as b:
            yield b, client, root
    finally:
        net.remove()
        remove_temp_root(root)


def run(out_dir: Path) -> list[Result]:
    results: list[Result] = []
    counter = itertools.count()
    with bench_broker() as (b, client, _root):
        stub = b.stub

        def docker_run() -> None:
            subprocess.run(["docker", "run", "--rm", "--network", "none", SANDBOX_IMAGE, "true"],
                           check=True, stdout=subprocess.DEVNULL)

        def ready(egress: bool) -> float:
            ticket = f"bench-{next(counter)}"
            t0 = time.perf_counter()
            stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(
                egress=["bench.invalid"] if egress else [])))
            _exec(stub, ticket, ["true"])
            dt = time.perf_counter() - t0
            stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
            return dt

        def timed(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        # Interleave baseline and measurements so that load from anything
        # else on the machine falls on all three alike.
        docker_run()
        ready(False)
        ready(True)
        samples: dict[str, list[float]] = {"base": [], "plain": [], "egress": []}
        for _ in range(7):
            samples["base"].append(timed(docker_run))
            samples["plain"].append(ready(False))
            samples["egress"].append(ready(True))
        base, plain, egress = (statistics.median(samples[k]) for k in ("base", "plain", "egress"))
        results.append(Result(ISSUE, "sandbox ready (create + first exec)", "docker run --rm --network none",
                              plain, base, 1.3))
        results.append(Result(ISSUE, "sandbox ready with egress proxy", "docker run --rm --network none",
                              egress, base, 2.5))

        # Exec of `true`: broker gRPC vs the SDK directly on the same container.
        ticket = "bench-exec"
        sb = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket))

        def sdk_exec() -> None:
            e = client.api.exec_create(sb.container_id, ["true"])
            client.api.exec_start(e["Id"])
            assert client.api.exec_inspect(e["Id"])["ExitCode"] == 0

        ours = median_time(lambda: _exec(stub, ticket, ["true"]), repeat=21, warmup=3)
        sdk = median_time(sdk_exec, repeat=21, warmup=3)
        results.append(Result(ISSUE, "Exec `true` via broker gRPC", "Docker SDK exec directly", ours, sdk, 1.15))

        # 4 KiB file read/write: tools over gRPC vs docker exec cat / tee.
        data = secrets.token_bytes(4096)
        stub.WriteFile(pb.WriteFileRequest(ticket_id=ticket, path="f.bin", content=data))
        name = sb.container_id

        def tool_rw() -> None:
            stub.WriteFile(pb.WriteFileRequest(ticket_id=ticket, path="f.bin", content=data))
            assert stub.ReadFile(pb.ReadFileRequest(ticket_id=ticket, path="f.bin")).content == data

        def docker_rw() -> None:
            subprocess.run(["docker", "exec", "-i", name, "tee", "/workspace/g.bin"], input=data, check=True,
                           stdout=subprocess.DEVNULL)
            out = subprocess.run(["docker", "exec", name, "cat", "/workspace/g.bin"], check=True,
                                 capture_output=True).stdout
            assert out == data

        ours = median_time(tool_rw, repeat=51, warmup=5)
        base_rw = median_time(docker_rw, repeat=7)
        results.append(Result(ISSUE, "4 KiB write+read via file tools", "docker exec tee + cat",
                              ours, base_rw, 0.1))
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
    for r in results:
        print(f"{r.name}: {r.measured_s * 1000:.1f} ms vs {r.baseline_s * 1000:.1f} ms -> {r.ratio:.2f}x "
              f"(target {r.target}x) {'met' if r.met else 'MISSED'}")
    return results


if __name__ == "__main__":
    run(Path("bench/out"))
