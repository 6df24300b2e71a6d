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

import asyncio
import itertools
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import docker
import grpc

from bench.common import Result, median_time
from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services._gen.afe.sandbox.v1 import sandbox_pb2_grpc
from services.common.grpcutil import _LinkAuth, socket_target
from services.common.layout import Layout
from services.common.links import new_secret
from services.common.redact import Redactor
from services.sandbox.broker import build_broker
from services.sandbox.images import SANDBOX_IMAGE, ensure_images

ISSUE = 3


class _Broker:
    """The real broker served from a thread with its own loop."""

    def __init__(self, root: Path, instance: str, **kw) -> None:
        self.layout = Layout(root / "data", root / "run")
        self.layout.ensure()
        self.instance = instance
        self.kw = kw
        self.secret = new_secret()
        self.socket = str(self.layout.socket("sandbox"))
        self.ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.stop_ev = asyncio.Event()
        b = build_broker(self.layout, self.socket, {"scheduler": self.secret}, Redactor(),
                         instance=self.instance, **self.kw)
        self.core = b
        await b.start()
        self.ready.set()
        await self.stop_ev.wait()
        await b.stop(0.5)
        await b.sandboxes.reconcile([])

    def __enter__(self):
        self.thread.start()
        self.ready.wait(60)
        creds = grpc.composite_channel_credentials(grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
                                                   grpc.metadata_call_credentials(_LinkAuth(self.secret)))
        self.channel = grpc.secure_channel(socket_target(self.socket), creds)
        self.stub = sandbox_pb2_grpc.SandboxBrokerStub(self.channel)
        return self

    def __exit__(self, *exc):
        self.channel.close()
        self.loop.call_soon_threadsafe(self.stop_ev.set)
        self.thread.join(60)


def _exec(stub, ticket: str, argv: list[str]) -> int:
    code = None
    for ev in stub.Exec(pb.ExecRequest(ticket_id=ticket, argv=argv)):
        if ev.WhichOneof("event") == "exit":
            code = ev.exit.code
    assert code == 0, code
    return code


def run(out_dir: Path) -> list[Result]:
    ensure_images(progress=lambda _m: None)
    client = docker.from_env()
    instance = "bench" + secrets.token_hex(4)
    root = Path(tempfile.mkdtemp(prefix="afe-bench-", dir="/tmp"))
    results: list[Result] = []
    counter = itertools.count()
    net = client.networks.create(f"afe-bench-{instance}", labels={"afe.instance": instance})
    net.reload()
    subnet = net.attrs["IPAM"]["Config"][0]["Subnet"]
    try:
        with _Broker(root, instance, egress_network=net.name, allow_private=(subnet,)) as b:
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

            def med(fn, n=5):
                fn()
                return sorted(fn() for _ in range(n))[n // 2]

            base = median_time(docker_run, repeat=5)
            plain = med(lambda: ready(False))
            egress = med(lambda: ready(True))
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
    finally:
        net.remove()
        shutil.rmtree(root, ignore_errors=True)
    for r in results:
        print(f"{r.name}: {r.measured_s * 1000:.1f} ms vs {r.baseline_s * 1000:.1f} ms -> {r.ratio:.2f}x "
              f"(target {r.target}x) {'met' if r.met else 'MISSED'}")
    return results


if __name__ == "__main__":
    run(Path("bench/out"))
