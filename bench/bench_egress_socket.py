"""Egress time to first byte over the socket transport (issue 34: the
relay in the proxy container and the sandbox's forwarder, socket_relay.py),
each a ratio against a baseline measured in the same run, with the real
sandbox broker and squid against a target server on the egress network:

- a plain HTTP GET on a new connection from a gVisor sandbox (its forwarder,
  the proxy's socket, the relay, squid) vs the same from a runc sandbox on
  its ticket network (squid straight away);
- the gVisor figure again while the sandbox holds 150 connections open on
  its proxy's socket (the relay it replaced stopped serving at about 60).

No target of their own: the rows say what the transport costs. Samples of
both kinds interleave, so load from anything else falls on both alike.
"""

from __future__ import annotations

import json
import secrets
import statistics
import time
from pathlib import Path

import docker

from bench.bench_sandbox import bench_broker
from bench.common import Result
from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.cli.doctor import TARGET_SERVER
from services.common.host.images import SANDBOX_IMAGE

ISSUE = 34
ROUNDS = 5
SAMPLES = 30           # per round and kind
HELD = 150

PROBE = """
import json, os, socket, sys, time
host, n, held_n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
phost, pport = os.environ["HTTP_PROXY"].split("//")[1].rsplit(":", 1)
req = f"GET http://{host}/ HTTP/1.1\\r\\nHost: {host}\\r\\nConnection: close\\r\\n\\r\\n".encode()
held = []
for _ in range(held_n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("/run/afe-egress/proxy.sock")
    held.append(s)

def one():
    t0 = time.perf_counter()
    s = socket.create_connection((phost, int(pport)))
    s.sendall(req)
    first = s.recv(1)
    dt = time.perf_counter() - t0
    while s.recv(65536):
        pass
    s.close()
    assert first == b"H", first
    return dt

for _ in range(3):
    one()
print(json.dumps([one() for _ in range(n)]))
"""


def _output(stub, ticket: str, argv: list[str]) -> bytes:
    out, code = [], None
    for ev in stub.Exec(pb.ExecRequest(ticket_id=ticket, argv=argv, timeout_ms=120_000), timeout=180):
        kind = ev.WhichOneof("event")
        if kind == "stdout":
            out.append(ev.stdout)
        elif kind == "exit":
            code = ev.exit.code
    assert code == 0, code
    return b"".join(out)


def _target(client: docker.DockerClient, network: str, name: str):
    """The doctor's small HTTP server (`TARGET-OK` on port 80), named `name` on `network`."""
    api = client.api
    cid = api.create_container(
        SANDBOX_IMAGE, ["python3", "-c", TARGET_SERVER], user="0", name=name,
        host_config=api.create_host_config(network_mode=network),
        networking_config=api.create_networking_config({network: api.create_endpoint_config(aliases=[name])}))["Id"]
    c = client.containers.get(cid)
    c.start()
    for _ in range(100):
        if b"ready" in c.logs():
            break
        time.sleep(0.1)
    return c


def run(out_dir: Path) -> list[Result]:
    if "runsc" not in (docker.from_env().info().get("Runtimes") or {}):
        print("egress socket: the engine has no runsc runtime (scripts/ensure_runsc.sh registers it): no rows")
        return []
    inst = secrets.token_hex(4)
    name = f"target-{inst}"
    with bench_broker() as (b, client, _root):
        target = _target(client, b.egress_network, name)
        tickets = {"gvisor": f"bench-egs-gv-{inst}", "runc": f"bench-egs-runc-{inst}"}
        try:
            for runtime, ticket in tickets.items():
                b.stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(
                    egress=[name], runtime="" if runtime == "runc" else runtime)))
            s: dict[str, list[float]] = {"gvisor": [], "runc": [], "held": []}
            for _ in range(ROUNDS):
                for kind, ticket, held in (("gvisor", tickets["gvisor"], 0), ("runc", tickets["runc"], 0),
                                           ("held", tickets["gvisor"], HELD)):
                    s[kind] += json.loads(_output(b.stub, ticket, ["python3", "-c", PROBE, name, str(SAMPLES),
                                                                   str(held)]))
        finally:
            for ticket in tickets.values():
                b.stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
            target.remove(force=True)
    m = {k: statistics.median(v) for k, v in s.items()}
    shape = f"plain HTTP GET, new connection each, median of {ROUNDS * SAMPLES}"
    results = [
        Result(ISSUE, "gVisor egress TTFB through the proxy's socket", "runc through the ticket network",
               m["gvisor"], m["runc"], None, notes=shape),
        Result(ISSUE, f"gVisor egress TTFB with {HELD} connections held on the socket", "the same, none held",
               m["held"], m["gvisor"], None, notes=shape),
    ]
    for r in results:
        print(f"{r.name}: {r.measured_s * 1000:.2f} ms vs {r.baseline} {r.baseline_s * 1000:.2f} ms -> {r.ratio:.2f}x")
    return results


if __name__ == "__main__":
    run(Path("bench/out"))
