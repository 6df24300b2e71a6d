"""Egress rules (issue 34, R44), each a ratio against a baseline measured in
the same run, with the real sandbox broker and squid proxy against a TLS
package host on the egress network (tests/support/egress_hosts.py):

- time to first byte of a GET on a new connection through the intercepting
  proxy (a host with rules: TLS terminated with the ticket's CA, the request
  judged, TLS again to the upstream) vs CONNECT pass-through to the same
  server (a host without rules): <= 1.3x;
- cold egress-ready (CreateSandbox + the first Exec of `true`) of a sandbox
  whose egress has no rules vs the same sandbox with the proxy of before the
  issue (bench/proxy_before.py: the GnuTLS build of squid and its
  configuration of then, for the same broker process): no worse (<= 1.0x; the
  quartiles of both are in the report's section, two medians of the same
  thing differ by some 5% on a busy 2-core machine);
- the same with rules (the ticket's CA made, its hosts decrypted) vs the
  proxy of before, and vs today's proxy without rules;
- the CPU time the proxy container used until the sandbox was ready (its
  cgroup), without and with rules vs the proxy of before: what the proxy
  itself costs, which load from the rest of the machine hardly moves (the
  wall-clock figures it moves by seconds on a busy 2-core machine): <= 1.0x
  without rules.

The measurements interleave their kinds, each after each other as often, so
load from anything else on the machine falls on all alike.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import secrets
import statistics
import time
from pathlib import Path

from bench import proxy_before
from bench.bench_sandbox import _exec, bench_broker
from bench.common import Result, Section
from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.common.host.images import PROXY_IMAGE, SANDBOX_IMAGE
from tests.support.egress_hosts import package_host
from tests.support.fakes.tls import make_ca_and_server_cert
from tests.support.temp_roots import remove_temp_root, temp_root

ISSUE = 34
READY_ROUNDS = 24
KINDS = ("before", "none", "rules")
TTFB_SAMPLES = 60

TTFB = """
import json, os, socket, ssl, sys, time
phost, pport = os.environ["HTTPS_PROXY"].split("//")[1].rsplit(":", 1)
bumped, plain, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
ctx = ssl.create_default_context(cafile="/workspace/trust.pem")

def one(host):
    t0 = time.perf_counter()
    s = socket.create_connection((phost, int(pport)))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(f"CONNECT {host}:443 HTTP/1.1\\r\\nHost: {host}:443\\r\\n\\r\\n".encode())
    head = b""
    while b"\\r\\n\\r\\n" not in head:
        head += s.recv(4096)
    assert b" 200 " in head.split(b"\\r\\n")[0], head
    t = ctx.wrap_socket(s, server_hostname=host)
    t.sendall(f"GET /demo-pkg HTTP/1.1\\r\\nHost: {host}\\r\\nConnection: close\\r\\n\\r\\n".encode())
    first = t.recv(1)
    dt = time.perf_counter() - t0
    rest = first + t.recv(64)
    assert rest.startswith(b"HTTP/1.1 200"), rest
    t.close()
    return dt

for _ in range(3):
    one(bumped), one(plain)
out = {"bumped": [], "plain": []}
for _ in range(n):
    out["bumped"].append(one(bumped))
    out["plain"].append(one(plain))
print(json.dumps(out))
"""


def _cpu_s(container_id: str) -> float | None:
    """The CPU time a container used so far, from its cgroup (v1 or v2); None where it cannot be read."""
    for path in (f"/sys/fs/cgroup/cpuacct/docker/{container_id}/cpuacct.usage",
                 f"/sys/fs/cgroup/cpu,cpuacct/docker/{container_id}/cpuacct.usage"):
        with contextlib.suppress(OSError, ValueError):
            return int(Path(path).read_text()) / 1e9
    for path in (f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/cpu.stat",
                 f"/sys/fs/cgroup/docker/{container_id}/cpu.stat"):
        with contextlib.suppress(OSError, ValueError):
            stat = dict(line.split() for line in Path(path).read_text().splitlines())
            return int(stat["usage_usec"]) / 1e6
    return None


def run(out_dir: Path) -> list[Result | Section]:
    inst = "bench" + secrets.token_hex(4)
    bumped, plain = f"bumped-{inst}", f"plain-{inst}"
    folder = temp_root("afe-bench-r44-")
    counter = itertools.count()
    proxy_before.ensure_image()
    try:
        ca = make_ca_and_server_cert(folder / "ca", [bumped, plain])
        env = {"AFE_CA_FILE": str(ca.ca_file)}
        # one broker for all kinds: its `before-` tickets get the proxy of before (bench/proxy_before.py)
        with bench_broker(env=env, module="bench.proxy_before") as (b, client, _root), \
                package_host(client, b.egress_network, [bumped, plain], inst, folder / "host", ca=ca):
            rules = [pb.EgressRule(host=bumped, methods=["GET", "HEAD"], name="read-only")]

            cpu: dict[str, list[float]] = {k: [] for k in KINDS}

            def ready(kind: str) -> float:
                ticket = f"{proxy_before.TICKET_PREFIX if kind == 'before' else 'today-'}r44-{next(counter)}"
                stub = b.stub
                t0 = time.perf_counter()
                sb = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(
                    image=SANDBOX_IMAGE, egress=[bumped, plain], egress_rules=rules if kind == "rules" else [])))
                _exec(stub, ticket, ["true"])
                dt = time.perf_counter() - t0
                used = _cpu_s(sb.proxy_container_id)
                image = client.api.inspect_container(sb.proxy_container_id)["Config"]["Image"]
                assert image == (proxy_before.IMAGE if kind == "before" else PROXY_IMAGE), (kind, image)
                if used is not None:
                    cpu[kind].append(used)
                stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
                return dt

            for kind in KINDS:                  # warm: images, the broker's CA-store cache of the image
                ready(kind)
            for used in cpu.values():
                used.clear()
            samples: dict[str, list[float]] = {k: [] for k in KINDS}
            orders = list(itertools.permutations(KINDS))    # each kind after each other kind as often
            for i in range(READY_ROUNDS):
                for kind in orders[i % len(orders)]:
                    samples[kind].append(ready(kind))

            stub = b.stub
            ticket = "bench-r44-ttfb"
            stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(
                image=SANDBOX_IMAGE, egress=[bumped, plain], egress_rules=rules)))
            try:
                stub.WriteFile(pb.WriteFileRequest(ticket_id=ticket, path="origin-ca.pem",
                                                   content=ca.ca_file.read_bytes()))
                _exec(stub, ticket, ["sh", "-c", ("cat /run/afe-ca/bundle.pem /workspace/origin-ca.pem "
                                                 "> /workspace/trust.pem")])
                out = b""
                for ev in stub.Exec(pb.ExecRequest(ticket_id=ticket, timeout_ms=300000,
                                                   argv=["python3", "-c", TTFB, bumped, plain, str(TTFB_SAMPLES)])):
                    if ev.WhichOneof("event") == "stdout":
                        out += ev.stdout
                    elif ev.WhichOneof("event") == "exit":
                        assert ev.exit.code == 0, out
                ttfb = json.loads(out)
            finally:
                stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
    finally:
        remove_temp_root(folder)
    bump_s, plain_s = statistics.median(ttfb["bumped"]), statistics.median(ttfb["plain"])
    before_s, none_s, rules_s = (statistics.median(samples[k]) for k in KINDS)

    def paired(kind: str) -> float:
        return statistics.median(x / y for x, y in zip(samples[kind], samples["before"], strict=True))

    def spread(xs: list[float]) -> str:
        q = statistics.quantiles(xs, n=4)
        return f"{q[0] * 1000:.1f}-{q[2] * 1000:.1f} ms"

    body = (f"TTFB, {TTFB_SAMPLES} interleaved samples: intercepting {bump_s * 1000:.2f} ms "
            f"(quartiles {spread(ttfb['bumped'])}), pass-through {plain_s * 1000:.2f} ms "
            f"(quartiles {spread(ttfb['plain'])}).\n\n"
            f"Cold egress-ready, {READY_ROUNDS} interleaved rounds: the proxy of before issue 34 "
            f"{before_s * 1000:.0f} ms (quartiles {spread(samples['before'])}), today's without rules "
            f"{none_s * 1000:.0f} ms (quartiles {spread(samples['none'])}), with rules {rules_s * 1000:.0f} ms "
            f"(quartiles {spread(samples['rules'])}); the median of each round's ratio: without rules "
            f"{paired('none'):.3f}, with rules {paired('rules'):.3f} of the proxy of before.")
    before_name = "the same egress, the proxy of before issue 34 (GnuTLS squid)"
    results: list[Result | Section] = [
        Result(ISSUE, "TTFB through the intercepting proxy (new connection, GET)", "CONNECT pass-through",
               bump_s, plain_s, 1.3),
        Result(ISSUE, "egress sandbox ready without rules (create + first exec)", before_name,
               none_s, before_s, 1.0),
        Result(ISSUE, "egress sandbox ready with rules (create + first exec)", before_name,
               rules_s, before_s, None),
        Result(ISSUE, "egress sandbox ready with rules (create + first exec)", "the same egress without rules",
               rules_s, none_s, 1.1),
    ]
    if all(len(cpu[k]) == READY_ROUNDS for k in KINDS):
        # what the proxy itself costs before the sandbox can use it, which the load of the rest of the
        # machine hardly moves (the wall-clock figures above it moves a lot)
        cb, cn, cr = (statistics.median(cpu[k]) for k in KINDS)
        results += [
            Result(ISSUE, "egress proxy CPU until it serves, without rules", before_name, cn, cb, 1.0),
            Result(ISSUE, "egress proxy CPU until it serves, with rules", before_name, cr, cb, None),
        ]
        body += (f"\n\nThe proxy's CPU time until the sandbox is ready (its cgroup): before {cb * 1000:.1f} ms "
                 f"(quartiles {spread(cpu['before'])}), today without rules {cn * 1000:.1f} ms "
                 f"(quartiles {spread(cpu['none'])}), with rules {cr * 1000:.1f} ms (quartiles {spread(cpu['rules'])}).")
    return [*results, Section("Egress rules (issue 34)", body)]
