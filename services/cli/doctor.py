"""`afe doctor`: prove on this machine that sandbox isolation really holds.

Checks the Docker engine and the images, then starts a probe sandbox (no
network), a probe egress sandbox with its squid proxy, and a local target
HTTP server container on a probe network of its own (never a public host),
and proves each of R5-R12 and R31 live. One PASS/FAIL line per rule with the
evidence; exit status 1 on any FAIL; everything it created is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import itertools
import os
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from services.common.layout import SANDBOX_UID, Layout

TARGET_SERVER = r'''
import http.server, socketserver, threading
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        b = b"TARGET-OK"
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers()
        self.wfile.write(b)
    def log_message(self, *a): pass
socketserver.ThreadingTCPServer.allow_reuse_address = True
for port in (80, 443, 8080):
    s = socketserver.ThreadingTCPServer(("0.0.0.0", port), H)
    threading.Thread(target=s.serve_forever, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
'''

FETCH = """import urllib.request, urllib.error, sys
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())
except urllib.error.HTTPError as e:
    print("HTTP", e.code)
except Exception as e:
    print("ERR", type(e).__name__)
"""

DIRECT = """import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close(); print("CONNECTED")
except Exception as e:
    print("ERR", type(e).__name__)
"""

CONNECT = """import socket, os, sys
host, port = os.environ["HTTPS_PROXY"].split("//")[1].split(":")
s = socket.create_connection((host, int(port)), timeout=10)
s.sendall(b"CONNECT " + sys.argv[1].encode() + b" HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
print(s.recv(200).split(b"\\r\\n")[0].decode())
"""

FORK = """import os, signal
pids, err = [], "none"
try:
    for i in range(200):
        pid = os.fork()
        if pid == 0:
            signal.pause(); os._exit(0)
        pids.append(pid)
except OSError as e:
    err = "EAGAIN" if e.errno == 11 else str(e.errno)
print(len(pids), err, flush=True)
for p in pids:
    os.kill(p, 9); os.waitpid(p, 0)
"""


# R31: a listener on every host address (TCP and UDP on 0.0.0.0 and ::, one
# port) that prints each connection's first line and each datagram, so a
# probe's arrival is seen by the host itself, not only by the prober.
LISTENER = r'''
import socket, sys, threading
port = int(sys.argv[1]) if len(sys.argv) > 1 else 0
lock = threading.Lock()
def out(kind, data):
    with lock:
        print(kind, data.decode("utf-8", "replace").strip(), flush=True)
def bind(fam, typ, addr, port):
    s = socket.socket(fam, typ)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if fam == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((addr, port))
    if typ == socket.SOCK_STREAM:
        s.listen(64)
    return s
for _ in range(50):
    socks = []
    try:
        socks.append(bind(socket.AF_INET, socket.SOCK_STREAM, "0.0.0.0", port))
        p = socks[0].getsockname()[1]
        socks.append(bind(socket.AF_INET, socket.SOCK_DGRAM, "0.0.0.0", p))
        try:
            socks += [bind(socket.AF_INET6, socket.SOCK_STREAM, "::", p),
                      bind(socket.AF_INET6, socket.SOCK_DGRAM, "::", p)]
        except OSError as e:
            if e.errno == 98:
                raise
        break
    except OSError:
        for s in socks:
            s.close()
        if port:
            raise
def conn(c):
    c.settimeout(5)
    try:
        out("tcp", c.recv(200))
    except OSError:
        pass
    c.close()
def serve(s):
    while True:
        if s.type == socket.SOCK_STREAM:
            c, _ = s.accept()
            threading.Thread(target=conn, args=(c,), daemon=True).start()
        else:
            out("udp", s.recvfrom(2048)[0])
for s in socks:
    threading.Thread(target=serve, args=(s,), daemon=True).start()
print("ready", p, flush=True)
threading.Event().wait()
'''

# R31: try TCP connect, a UDP datagram and an ICMP echo (an unprivileged ICMP
# datagram socket) to each address; prints one JSON object. Every packet
# carries the token, so a listener knows whose it is.
PROBE = r'''
import json, socket, struct, sys, threading
token, port, addrs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
res = {}
def err(e):
    return "ERR " + (type(e).__name__ if isinstance(e, TimeoutError) or not e.errno else str(e.errno))
def tcp(a):
    try:
        fam, typ, proto, _, sa = socket.getaddrinfo(a, port, 0, socket.SOCK_STREAM)[0]
        with socket.socket(fam, typ, proto) as s:
            s.settimeout(2)
            s.connect(sa)
            s.sendall(f"{token} tcp {a}\n".encode())
        return "CONNECTED"
    except OSError as e:
        return err(e)
def udp(a):
    try:
        fam, typ, proto, _, sa = socket.getaddrinfo(a, port, 0, socket.SOCK_DGRAM)[0]
        with socket.socket(fam, typ, proto) as s:
            s.sendto(f"{token} udp {a}".encode(), sa)
        return "SENT"
    except OSError as e:
        return err(e)
def icmp(a):
    v6 = ":" in a
    fam = socket.AF_INET6 if v6 else socket.AF_INET
    try:
        s = socket.socket(fam, socket.SOCK_DGRAM, socket.IPPROTO_ICMPV6 if v6 else socket.IPPROTO_ICMP)
    except OSError as e:
        return "NOSOCK " + err(e)
    with s:
        s.settimeout(2)
        try:
            sa = socket.getaddrinfo(a, 0, fam, socket.SOCK_DGRAM)[0][4]
            s.sendto(struct.pack("!BBHHH", 128 if v6 else 8, 0, 0, 0, 1) + token.encode(), sa)
            while True:
                d = s.recvfrom(2048)[0]
                if d[0] == (129 if v6 else 0) and token.encode() in d:
                    return "REPLY"
        except OSError as e:
            return err(e)
def one(a):
    res[a] = {"tcp": tcp(a), "udp": udp(a), "icmp": icmp(a)}
ts = [threading.Thread(target=one, args=(a,)) for a in addrs]
for t in ts:
    t.start()
for t in ts:
    t.join()
print(json.dumps(res))
'''


def host_addresses(inside_if: str = "eth0") -> list[str]:
    """Every address of this host on every interface but loopback, as a
    probe target seen from a container: IPv6 link-local ones scoped to the
    container's own interface. From `ip -j addr`, or /proc without iproute2."""
    out: list[str] = []
    if shutil.which("ip"):
        import json
        import subprocess

        from services.common.childenv import tool_env
        doc = json.loads(subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True,
                                        check=True, timeout=10, env=tool_env()).stdout)
        addrs = [a["local"] for i in doc for a in i.get("addr_info", []) if "local" in a]
    else:
        addrs = []
        with open("/proc/net/fib_trie") as f:
            lines = f.read().splitlines()
        for prev, line in itertools.pairwise(lines):
            if line.strip() == "/32 host LOCAL":
                addrs.append(prev.split()[-1])
        with contextlib.suppress(FileNotFoundError), open("/proc/net/if_inet6") as f:
            for line in f:
                h = line.split()[0]
                addrs.append(str(ipaddress.IPv6Address(int(h, 16))))
    for addr in addrs:
        ip = ipaddress.ip_address(addr.split("%")[0])
        if ip.is_loopback:
            continue
        target = f"{ip}%{inside_if}" if ip.version == 6 and ip.is_link_local else str(ip)
        if target not in out:
            out.append(target)
    return out


class HostListener:
    """LISTENER in a child process on this host; `lines` collects what it
    received. A context manager: the child is ended on exit."""

    def __init__(self) -> None:
        import subprocess
        import threading

        from services.common.childenv import tool_env
        self.proc = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True,
                                     env=tool_env())
        first = self.proc.stdout.readline().split()
        if first[:1] != ["ready"]:
            self.close()
            raise RuntimeError("the host listener did not start")
        self.port = int(first[1])
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.strip())
                self._changed.notify_all()

    def received(self, token: str) -> list[str]:
        with self._changed:
            return [x for x in self.lines if f" {token} " in f" {x} "]

    def wait_for(self, token: str, count: int, timeout: float = 5.0) -> list[str]:
        """What arrived with `token`, once `count` lines have (or at timeout)."""
        with self._changed:
            self._changed.wait_for(lambda: len([x for x in self.lines if f" {token} " in f" {x} "]) >= count,
                                   timeout)
        return self.received(token)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reached(result: dict, listener_lines: list[str]) -> list[str]:
    """What a probe got through: 'tcp A', 'udp A' (the host received it) and
    'icmp A' (an echo reply came back)."""
    got = {f"tcp {a}" for a, r in result.items() if r["tcp"] == "CONNECTED"}
    got |= {f"icmp {a}" for a, r in result.items() if r["icmp"] == "REPLY"}
    for line in listener_lines:            # "<kind> <token> <kind> <address>"
        parts = line.split()
        if len(parts) == 4:
            got.add(f"{parts[2]} {parts[3]}")
    return sorted(got)


@dataclass
class Report:
    lines: list[tuple[str, bool, str]] = field(default_factory=list)

    def add(self, rule: str, ok: bool, evidence: str) -> None:
        self.lines.append((rule, ok, evidence))
        print(f"{'PASS' if ok else 'FAIL'} {rule}: {evidence}", flush=True)

    @property
    def failed(self) -> bool:
        return any(not ok for _, ok, _ in self.lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="prove the sandbox isolation rules live on this machine",
                       description="Check the Docker engine and images, then start probe containers and prove "
                       "R5-R12 and R31 (one PASS/FAIL line per rule). Exit status 1 on any FAIL.")
    p.add_argument("--no-build", action="store_true", help="do not build missing images")
    p.add_argument("--egress-network", default="bridge", metavar="NAME",
                   help="the network `afe up --egress-network` gives the egress proxies (default: bridge)")
    p.add_argument("--config", default=None, metavar="DIR",
                   help="manifest folder whose private egress entries to show (default: ./afe.d when it exists)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(doctor(build=not args.no_build, egress_network=args.egress_network, config_dir=args.config))


def _egress_settings(report: Report, client, network: str, config_dir: str | None) -> None:
    """The egress network exists, and which private destinations the manifests allow."""
    from services.common.errors import ConfigError
    from services.common.manifests import load_config
    from services.launcher.launch import egress_lines

    try:
        driver = client.api.inspect_network(network).get("Driver", "?")
        report.add("egress network", True, f"{network} exists (driver {driver}); the egress proxies join it")
    except Exception:  # noqa: BLE001 - docker.errors.NotFound or an engine error: either way unusable
        report.add("egress network", False, f"no Docker network named {network}; create it or pass "
                   "--egress-network NAME to `afe up` and `afe doctor`")
    directory = config_dir or ("afe.d" if Path("afe.d").is_dir() else None)
    if directory is None:
        print("info private egress: no --config and no ./afe.d; none configured (every private address is "
              "refused)")
        return
    try:
        config = load_config(directory)
    except ConfigError as exc:
        report.add("private egress", False, str(exc).splitlines()[0] + "; run `afe check`")
        return
    print("info " + egress_lines(config, network)[1].strip(), flush=True)


async def _exec(runner, ticket: str, argv: list[str], timeout_ms: int = 30000) -> tuple[int, str]:
    from services.sandbox.execs import Exit
    out: list[bytes] = []
    code = -1
    async for ev in runner.run_exec(ticket, argv, timeout_ms=timeout_ms):
        if isinstance(ev, Exit):
            code = ev.code
        else:
            out.append(ev.data)
    return code, b"".join(out).decode("utf-8", "replace").strip()


async def _py(runner, ticket: str, script: str, *args: str) -> str:
    return (await _exec(runner, ticket, ["python3", "-c", script, *args]))[1]


async def doctor(build: bool = True, egress_network: str = "bridge", config_dir: str | None = None) -> int:
    import docker

    from services.common.errors import AfeError
    from services.sandbox import images

    report = Report()
    try:
        images.check_engine()
        client = docker.from_env()
        v = client.version()
        report.add("engine", True, f"Docker {v.get('Version')} (API {v.get('ApiVersion')})")
    except Exception as exc:  # noqa: BLE001 - any failure here means "no engine"
        report.add("engine", False, f"Docker engine not reachable ({type(exc).__name__}); start it or set DOCKER_HOST")
        return 1
    try:
        if build:
            images.ensure_images(progress=lambda m: print("  " + m, flush=True))
        missing = [i for i in (images.SANDBOX_IMAGE, images.PROXY_IMAGE) if not images._present(i)]
        report.add("images", not missing, "missing: " + ", ".join(missing) if missing else
                   f"{images.SANDBOX_IMAGE} and {images.PROXY_IMAGE} present")
        if missing:
            return 1
    except AfeError as exc:
        report.add("images", False, str(exc).splitlines()[0])
        return 1
    _egress_settings(report, client, egress_network, config_dir)

    instance = "doctor-" + secrets.token_hex(4)
    tmp = Path(tempfile.mkdtemp(prefix="afe-doctor-", dir="/tmp"))
    net = target = None
    mgr = None
    try:
        net = client.networks.create(f"afe-{instance}-probe", labels={"afe.instance": instance})
        net.reload()
        subnet = net.attrs["IPAM"]["Config"][0]["Subnet"]
        tname = f"target-{instance}"
        target = client.containers.run(images.SANDBOX_IMAGE, ["python3", "-c", TARGET_SERVER], user="0",
                                       detach=True, name=tname, network=net.name,
                                       labels={"afe.instance": instance})
        for _ in range(100):
            if b"ready" in target.logs():
                break
            await asyncio.sleep(0.1)
        target.reload()
        tip = target.attrs["NetworkSettings"]["Networks"][net.name]["IPAddress"]
        await _probe(report, client, tmp, instance, net.name, subnet, tname, tip)
    except Exception as exc:  # noqa: BLE001 - the probe itself broke: a FAIL, with what broke
        report.add("probe", False, f"could not run the probes: {type(exc).__name__}: {str(exc)[:300]}")
    finally:
        from services.sandbox.sandboxes import SandboxManager
        with contextlib.suppress(Exception):
            mgr = SandboxManager(Layout(tmp / "data", tmp / "run"), instance=instance, client=client)
            await mgr.reconcile([])
        for obj in (target, net):
            with contextlib.suppress(Exception):
                if obj is target and obj is not None:
                    obj.remove(force=True)
                elif obj is not None:
                    obj.remove()
        shutil.rmtree(tmp, ignore_errors=True)
        left = client.containers.list(all=True, filters={"label": f"afe.instance={instance}"})
        left_n = client.networks.list(filters={"label": f"afe.instance={instance}"})
        if left or left_n:
            report.add("teardown", False, f"{len(left)} containers and {len(left_n)} networks left behind")
        else:
            print("teardown: every probe object removed")
    print("afe doctor: " + ("FAIL" if report.failed else "all rules PASS"))
    return 1 if report.failed else 0


async def _probe(report: Report, client, tmp: Path, instance: str, network: str, subnet: str,
                 tname: str, tip: str) -> None:
    from services.sandbox.execs import Exit, Runner
    from services.sandbox.hardening import SandboxSettings
    from services.sandbox.sandboxes import SandboxManager

    probe_value = "doctor-probe-" + secrets.token_hex(8)
    layout = Layout(tmp / "data", tmp / "run")
    layout.ensure()
    if os.geteuid() != 0:
        # Without root the broker cannot give the probe workspaces to the
        # sandbox uid; open them up instead (they are throwaway).
        for t in ("doctor-plain", "doctor-egress"):
            layout.workspace(t).mkdir(parents=True, exist_ok=True)
            os.chmod(layout.workspace(t), 0o777)
    mgr = SandboxManager(layout, instance=instance, egress_network=network, allow_private=[subnet],
                         env_values={"AFE_DOCTOR_PROBE": probe_value}, client=client)
    runner = Runner(mgr)
    t0 = time.monotonic()
    plain_settings = SandboxSettings(ticket_id="doctor-plain", pids=64, memory_bytes=64 * 1024 ** 2,
                                     disk_bytes=32 * 1024 ** 2, env_names=("AFE_DOCTOR_PROBE",))
    # A warm sandbox (services/scheduler/pool.py): made ahead for a reserved id, as the pool fills;
    # claimed by the ticket given that id, whose own create finds it. Every probe below runs on it.
    pooled = await mgr.create(plain_settings)
    plain = await mgr.create(plain_settings)
    attrs = client.api.inspect_container(plain.container_id)
    hc = attrs["HostConfig"]
    label = attrs["Config"]["Labels"].get("afe.ticket")
    report.add("pool: the probes below run on a claimed warm sandbox",
               plain.container_id == pooled.container_id and label == "doctor-plain",
               f"made ahead as container {pooled.container_id[:12]}, claimed {plain.container_id[:12]}; "
               f"afe.ticket={label} (R12: the label of the ticket it serves, from birth)")

    # R4: commands run inside the container, not on the host.
    _, hostname = await _exec(runner, "doctor-plain", ["hostname"])
    report.add("R4 commands run in the sandbox", hostname == "sandbox",
               f"exec ran in container {plain.container_id[:12]} (hostname={hostname})")

    _, ifaces = await _exec(runner, "doctor-plain", ["ls", "/sys/class/net"])
    report.add("R5 no network by default", hc["NetworkMode"] == "none" and ifaces.split() == ["lo"],
               f"NetworkMode={hc['NetworkMode']}, interfaces={ifaces.split()}")

    _, status = await _exec(runner, "doctor-plain", ["grep", "-E", "^(CapEff|NoNewPrivs)", "/proc/self/status"])
    fork = await _py(runner, "doctor-plain", FORK)
    memcode, _ = await _exec(runner, "doctor-plain",
                             ["python3", "-c", "b = bytearray(256 * 1024 * 1024); print(len(b))"])
    ok6 = (hc["CapDrop"] == ["ALL"] and not hc.get("CapAdd") and "no-new-privileges" in hc["SecurityOpt"]
           and not hc["Privileged"] and "CapEff:\t0000000000000000" in status and "NoNewPrivs:\t1" in status
           and hc["NanoCpus"] > 0 and hc["Memory"] > 0 and hc["PidsLimit"] > 0
           and fork.endswith("EAGAIN") and memcode == 137)
    report.add("R6 caps dropped, no-new-privileges, limits", ok6,
               f"CapDrop={hc['CapDrop']}, {status.replace(chr(9), ' ').replace(chr(10), ', ')}, "
               f"cpus={hc['NanoCpus'] / 1e9}, memory={hc['Memory']}, pids={hc['PidsLimit']}; "
               f"fork probe: {fork} ; 256 MiB allocation exit={memcode}")

    _, uid = await _exec(runner, "doctor-plain", ["id", "-u"])
    report.add("R7 non-root user", uid == str(SANDBOX_UID) and attrs["Config"]["User"].split(":")[0] != "0",
               f"User={attrs['Config']['User']}, id -u={uid}")

    rootw, _ = await _exec(runner, "doctor-plain", ["touch", "/doctor-probe"])
    wsw, _ = await _exec(runner, "doctor-plain", ["touch", "/workspace/.doctor-probe"])
    find_socket = ("find / -xdev -name 'docker.sock' 2>/dev/null; "
                   "ls /var/run/docker.sock /run/docker.sock 2>/dev/null")
    _, socks = await _exec(runner, "doctor-plain", ["bash", "-c", find_socket])
    binds = [m["Destination"] for m in attrs["Mounts"] if m["Type"] == "bind"]
    ok8 = attrs["HostConfig"]["ReadonlyRootfs"] and rootw != 0 and wsw == 0 and binds == ["/workspace"] \
        and not socks
    report.add("R8 /workspace the only writable mount, no Docker socket", ok8,
               f"ReadonlyRootfs={hc['ReadonlyRootfs']}, write / exit={rootw}, write /workspace exit={wsw}, "
               f"binds={binds}, docker.sock found: {socks or 'none'}")

    # R34: which disk cap holds; with a loop-mounted image, writing past 32m gives ENOSPC.
    if mgr.diskcap.mode == "mount":
        fill, fout = await _exec(runner, "doctor-plain", [
            "bash", "-c", ("dd if=/dev/zero of=/workspace/.doctor-fill bs=1M count=48 2>&1; "
                           "r=$?; rm -f /workspace/.doctor-fill; exit $r")])
        report.add("R34 workspace disk cap", fill != 0 and "No space left" in fout,
                   f"mount mode ({mgr.diskcap.why}); writing 48 MiB under a 32m cap -> exit {fill}, "
                   f"{'ENOSPC' if 'No space left' in fout else 'no ENOSPC'}")
    else:
        report.add("R34 workspace disk cap", True,
                   f"watchdog mode ({mgr.diskcap.why}): usage measured every second, the sandbox is "
                   "stopped past the cap (overshoot: about one second of writes)")

    env = [e.split("=", 1)[0] for e in attrs["Config"]["Env"]]
    _, seen_exec = await _exec(runner, "doctor-plain", ["printenv", "AFE_DOCTOR_PROBE"])
    proc = await runner.start_process("doctor-plain", ["printenv", "AFE_DOCTOR_PROBE"],
                                      env_names=["AFE_DOCTOR_PROBE"])
    proc.close_stdin()
    seen_proc = b"".join([ev.data async for ev in proc.output() if not isinstance(ev, Exit)]).decode().strip()
    ok9 = (set(env) <= {"PATH", "LANG", "HOME", "PYTHONDONTWRITEBYTECODE"} and probe_value not in repr(attrs)
           and seen_exec == "" and seen_proc == probe_value)
    report.add("R9 no environment but declared names, passed by name", ok9,
               f"container env names={sorted(env)}; declared value absent from inspect; plain exec sees "
               f"{'it' if seen_exec else 'nothing'}; a process given the name sees "
               f"{'it' if seen_proc == probe_value else 'nothing'}")

    eg = await mgr.create(SandboxSettings(ticket_id="doctor-egress", egress=(tname, "localhost")))
    allowed = await _py(runner, "doctor-egress", FETCH, f"http://{tname}/")
    other = await _py(runner, "doctor-egress", FETCH, f"http://other-{instance}.invalid/")
    report.add("R10 egress is an allowlist", allowed == "TARGET-OK" and other.startswith("HTTP 403")
               and hc["NetworkMode"] == "none",
               f"no-egress sandbox NetworkMode=none; allowed name -> {allowed}; unlisted name -> {other}")

    literal = await _py(runner, "doctor-egress", FETCH, f"http://{tip}/")
    loop = await _py(runner, "doctor-egress", FETCH, "http://localhost/")
    port = await _py(runner, "doctor-egress", CONNECT, f"{tname}:8080")
    tls = await _py(runner, "doctor-egress", CONNECT, f"{tname}:443")
    direct = await _py(runner, "doctor-egress", DIRECT, tip, "80")
    _, dns = await _exec(runner, "doctor-egress", ["bash", "-c", f"getent hosts {tname} || echo FAILED"])
    eattrs = client.api.inspect_container(eg.container_id)
    ok11 = (literal == "HTTP 403" and loop == "HTTP 403" and "403" in port and "200" in tls
            and direct.startswith("ERR") and dns == "FAILED"
            and eattrs["HostConfig"]["NetworkMode"] == eg.network
            and client.api.inspect_network(eg.network)["Internal"])
    report.add("R11 only listed hosts via the proxy, no bypass", ok11,
               f"internal network {eg.network}; IP literal -> {literal}; name resolving to loopback -> {loop}; "
               f"CONNECT :8080 -> {port}; CONNECT :443 -> {tls}; direct TCP -> {direct}; DNS -> {dns}")

    await _probe_r31(report, client, runner, eg, instance, network, tip)

    flt = {"label": ["afe.ticket=doctor-egress", f"afe.instance={instance}"]}
    before = (len(client.containers.list(all=True, filters=flt)), len(client.networks.list(filters=flt)))
    removed = await mgr.destroy("doctor-egress")
    after = (len(client.containers.list(all=True, filters=flt)), len(client.networks.list(filters=flt)))
    report.add("R12 labelled with afe.ticket, gone with the ticket", before == (2, 1) and after == (0, 0),
               f"labelled (containers, networks) before destroy={before}, after={after}, removed={removed}")
    await mgr.destroy("doctor-plain")
    print(f"(probes took {time.monotonic() - t0:.1f}s)")


async def _probe_r31(report: Report, client, runner, eg, instance: str, network: str, tip: str) -> None:
    """R31 live: from the egress sandbox, TCP, UDP and ICMP to every address
    of this host, to the ticket network's gateway and to the other probe
    containers; a host listener records what arrives. The same probe from a
    plain container on the probe network shows the host does answer."""
    import json

    from services.common.layout import SANDBOX_GID
    from services.sandbox import images

    gw = (client.api.inspect_network(eg.network)["IPAM"]["Config"] or [{}])[0].get("Gateway", "")
    proxy_nets = client.api.inspect_container(eg.proxy_container_id)["NetworkSettings"]["Networks"]
    others = [tip, *(n["IPAddress"] for name, n in proxy_nets.items() if name != eg.network and n.get("IPAddress"))]
    sbx, ctl = "sbx-" + secrets.token_hex(6), "ctl-" + secrets.token_hex(6)
    with HostListener() as listener:
        hosts = host_addresses()
        targets = list(dict.fromkeys([*hosts, *([gw] if gw else []), *others]))
        port = str(listener.port)
        raw = await _py(runner, eg.ticket_id, PROBE, sbx, port, *targets)
        out = await asyncio.to_thread(
            client.containers.run, images.SANDBOX_IMAGE, ["python3", "-c", PROBE, ctl, port, *targets],
            network=network, user=f"{SANDBOX_UID}:{SANDBOX_GID}", cap_drop=["ALL"], remove=True,
            labels={"afe.instance": instance})
        try:
            res, cres = json.loads(raw), json.loads(out)
        except ValueError:
            report.add("R31 egress sandbox reaches only its proxy", False,
                       f"the probe printed no result: {raw[-300:]!r}")
            return
        connected = sum(r["tcp"] == "CONNECTED" for r in cres.values())
        control = reached(cres, await asyncio.to_thread(listener.wait_for, ctl, 2 * connected))
        got = reached(res, listener.received(sbx))
    icmp = "" if not any(r["icmp"].startswith("NOSOCK") for r in res.values()) else \
        " (no ICMP socket in the sandbox: ICMP not tested)"
    report.add("R31 egress sandbox reaches only its proxy", set(res) == set(targets) and not got,
               f"TCP, UDP and ICMP from the egress sandbox to {len(hosts)} host addresses ({', '.join(hosts)}), "
               f"its network's gateway {gw or '(none)'} and other containers ({', '.join(others)}) -> "
               f"{'reached ' + ', '.join(got) if got else 'nothing reached'}{icmp}; control from a plain "
               f"container: {len(control)} reached" + ("" if control else " (a host firewall already blocks "
                                                       "containers)"))


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace(no_build=False)))
