"""The canary sweep (R2, R9, R13, R25-R30): run real tickets through `afe up`
with a distinct canary value in every secret slot, then search every sink
for every canary.

Secret slots: the workspace `tokenEnv`, a model `apiKeyEnv`, an ACP-declared
name, the UI token, `OTEL_EXPORTER_OTLP_HEADERS`, and a password inside
`AFE_DATABASE_URL`.

Tickets: the demo (model fix -> tests -> PR -> approval -> merge), a probe
that dumps the sandbox's environment and git config into its output, a
model ticket on an OpenAI-compatible fake, a model ticket whose API answers
401 echoing the key back, an egress ticket (squid proxy) and an ACP ticket.

Sinks: every process log, the store file, every event (read back through
the gateway), every /metrics and /readyz page, every span the local OTLP
receiver got, `docker inspect` of every container (env, cmd, labels),
/proc/*/cmdline snapshots taken during the run, every file under the data
folder (workspaces, their scratch git, host git dirs, mirrors, forge), and
the error texts of deliberately failed calls.

Only the ACP-declared value may appear, and only inside its own sandbox's
environment (the agent process's /proc/<pid>/environ). A failure names the
canary and the sink.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import docker
import grpc
import pytest

from services._gen.afe.credentials.v1 import credentials_pb2, credentials_pb2_grpc
from services._gen.afe.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common import demo
from services.common.rpc.grpcutil import open_channel
from tests.support.fakes.models import FakeOpenAI
from tests.support.otlp import OtlpReceiver
from tests.support.temp_roots import remove_temp_root, temp_root

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MARKER = "afe-sweep-control-marker"   # NOT a secret: must show up in the sinks


def _canary(tag: str) -> str:
    return f"cnry{tag}{secrets.token_hex(10)}"


CANARIES = {
    "tokenEnv": ("CS_GIT_TOKEN", _canary("git")),
    "apiKeyEnv": ("CS_MODEL_KEY", _canary("model")),
    "acp env": ("CS_ACP_KEY", _canary("acp")),
    "UI token": ("AFE_UI_TOKEN", _canary("ui")),
    "OTLP headers": ("OTEL_EXPORTER_OTLP_HEADERS", _canary("otlp")),
    "store password": ("AFE_DATABASE_URL", _canary("db")),
}


def forms(value: str) -> dict[str, bytes]:
    return {"raw": value.encode(), "base64": base64.b64encode(value.encode()).rstrip(b"="),
            "hex": value.encode().hex().encode()}


def config_text(model_url: str, acp_image: str | None, acp_command: tuple[str, ...] | None) -> str:
    docs = ["""\
kind: Workspace
name: demo
repo: repos/calc.git
baseBranch: main
tokenEnv: CS_GIT_TOKEN
forge: {type: local}
sandbox: {image: afe/sandbox:latest, limits: {cpus: 1, memory: 512m, pids: 256}}
""", """\
kind: Workspace
name: egress
repo: repos/calc.git
tokenEnv: CS_GIT_TOKEN
forge: {type: local}
sandbox: {image: afe/sandbox:latest, egress: [pypi.org]}
""", """\
kind: Model
name: demo-model
provider: replay
script: demo-model.yaml
""", f"""\
kind: Model
name: remote
provider: openai
model: sweep-model
baseUrl: {model_url}/v1
apiKeyEnv: CS_MODEL_KEY
""", """\
kind: Workflow
name: demo-fix
workspace: demo
nodes:
  - {id: fix, model: demo-model, prompt: "Fix the failing test. {{ticket.title}}", tools: [read_file, write_file, list_dir, run], max_turns: 8}
  - {id: test, run: "python3 -m unittest -v", needs: [fix], timeout: 120}
  - {id: pr, uses: "builtin:open_pr", needs: [test]}
  - {id: merge, uses: "builtin:merge", needs: [pr]}
""", f"""\
kind: Workflow
name: probe
workspace: demo
nodes:
  - id: dump
    run: "echo {MARKER}; env; cat /proc/self/environ /proc/1/environ; cat /workspace/.git/config; git -C /workspace config --list; ls -la /workspace; true"
    timeout: 60
""", """\
kind: Workflow
name: ask
workspace: demo
nodes:
  - {id: ask, model: remote, prompt: "Say hello about {{ticket.title}}", max_turns: 2}
""", f"""\
kind: Workflow
name: egress-run
workspace: egress
nodes:
  - {{id: env, run: "echo {MARKER}-egress; env", timeout: 60}}
"""]
    if acp_image and acp_command:
        docs += [f"""\
kind: Workspace
name: acp
repo: repos/calc.git
tokenEnv: CS_GIT_TOKEN
forge: {{type: local}}
sandbox: {{image: "{acp_image}"}}
""", f"""\
kind: Agent
name: coder
type: acp
command: {json.dumps(list(acp_command))}
env: [CS_ACP_KEY]
""", """\
kind: Workflow
name: acp-code
workspace: acp
nodes:
  - {id: code, agent: coder, prompt: "say hello", timeout: 120}
"""]
    return "---\n".join(docs)


# ---- watchers that snapshot sinks while the run is in progress -------------------

class Poller(threading.Thread):
    def __init__(self, fn, interval: float) -> None:
        super().__init__(daemon=True)
        self.fn, self.interval = fn, interval
        self.stop_event = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.fn()
            except Exception as exc:  # noqa: BLE001 - a vanished process or container is normal here
                if len(self.errors) < 20:
                    self.errors.append(repr(exc))
            self.stop_event.wait(self.interval)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(10)


@dataclass
class Sweep:
    instance: str
    base: Path
    logs: str = ""
    cmdlines: dict[str, bytes] = field(default_factory=dict)        # cmdline -> first pid seen
    agent_environs: dict[str, bytes] = field(default_factory=dict)  # pid -> environ of ACP agents
    containers: dict[str, dict] = field(default_factory=dict)       # id -> docker inspect
    events: dict[str, list] = field(default_factory=dict)           # ticket -> events (via gateway)
    tickets: dict[str, dict] = field(default_factory=dict)          # name -> final ticket
    metrics: dict[str, str] = field(default_factory=dict)           # service page -> text
    errors: list[tuple[str, str]] = field(default_factory=list)     # (call, error text)
    files_during: dict[str, bytes] = field(default_factory=dict)
    files_after: dict[str, bytes] = field(default_factory=dict)
    store: dict[str, bytes] = field(default_factory=dict)
    spans: list = field(default_factory=list)
    otlp_requests: list = field(default_factory=list)
    model_requests: list = field(default_factory=list)
    acp: bool = False
    leftovers: list = field(default_factory=lambda: ["not checked"])

    def sinks(self) -> dict[str, list[tuple[str, bytes]]]:
        return {
            "process logs": [("afe up output", self.logs.encode())],
            "store file": list(self.store.items()),
            "events": [(t, json.dumps(ev).encode()) for t, ev in self.events.items()],
            "tickets": [(n, json.dumps(t).encode()) for n, t in self.tickets.items()],
            "/metrics and /readyz pages": [(k, v.encode()) for k, v in self.metrics.items()],
            "spans": [(f"{s.service} {s.name}", s.text().encode()) for s in self.spans],
            "docker inspect": [(cid[:12], json.dumps(c).encode()) for cid, c in self.containers.items()],
            "/proc/*/cmdline": [(k.decode("latin-1")[:80], k) for k in self.cmdlines],
            "files during the run": list(self.files_during.items()),
            "files after the run": list(self.files_after.items()),
            "error texts": [(call, text.encode()) for call, text in self.errors],
        }


def read_tree(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, files in os.walk(root, followlinks=False):
        for name in files:
            p = Path(dirpath) / name
            try:
                if p.is_symlink() or not p.is_file() or p.stat().st_size > 20_000_000:
                    continue
                out[str(p.relative_to(root))] = p.read_bytes()
            except OSError:
                continue
    return out


def snapshot_procs(sweep: Sweep) -> None:
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
        except OSError:
            continue
        if cmd and cmd not in sweep.cmdlines:
            sweep.cmdlines[cmd] = d.encode()


# The ACP agent lives about two seconds. A thread of this test process sharing the
# GIL with the run's loop, the docker poller and the log pump can take longer than
# that for one pass over /proc on a loaded machine (every read lets go of the GIL
# and waits for it again), so the agents are watched by a process of their own.
AGENT_WATCHER = r"""
import os, sys, time
out = sys.argv[1]
while not os.path.exists(os.path.join(out, "stop")):
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if b"/opt/acp/agents/" not in f.read():
                    continue
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if env:
            with open(os.path.join(out, d + ".tmp"), "wb") as f:
                f.write(env)
            os.replace(os.path.join(out, d + ".tmp"), os.path.join(out, d))
    time.sleep(0.05)
"""


class AgentWatcher:
    """Copies the environment of every ACP agent process into `out`, one file a pid."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-c", AGENT_WATCHER, str(out)], env={"PATH": os.environ.get("PATH", "")})

    def stop(self, sweep: Sweep) -> None:
        (self.out / "stop").touch()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        for f in self.out.iterdir():
            if f.name.isdigit():
                sweep.agent_environs[f.name] = f.read_bytes()


def snapshot_containers(sweep: Sweep, client: docker.DockerClient) -> None:
    for c in client.containers.list(all=True, filters={"label": f"afe.instance={sweep.instance}"}):
        sweep.containers[c.id] = client.api.inspect_container(c.id)


# ---- the run ----------------------------------------------------------------------

class Rpc:
    def __init__(self, ws) -> None:
        self.ws, self.n = ws, 0
        self.pending: list[dict] = []

    async def call(self, method: str, params: dict | None = None, timeout: float = 60) -> dict:
        self.n += 1
        rid = self.n
        await self.ws.send_str(json.dumps({"jsonrpc": "2.0", "id": rid, "method": method,
                                           "params": params or {}}))
        while True:
            m = await self.ws.receive(timeout=timeout)
            assert m.type == aiohttp.WSMsgType.TEXT, (m.type, m.data)
            doc = json.loads(m.data)
            if doc.get("id") == rid:
                return doc
            self.pending.append(doc)

    async def ok(self, method: str, params: dict | None = None) -> dict:
        doc = await self.call(method, params)
        assert "error" not in doc, (method, doc)
        return doc["result"]

    async def events(self, ticket_id: str) -> list[dict]:
        sub = (await self.ok("tickets.watch", {"id": ticket_id, "from_seq": 0, "follow": False}))["subscription"]
        out = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            while self.pending:
                doc = self.pending.pop(0)
                params = doc.get("params") or {}
                if params.get("subscription") != sub:
                    continue
                if doc.get("method") == "tickets.event":
                    out.append(params["event"])
                elif doc.get("method") == "tickets.watch_end":
                    return out
            m = await self.ws.receive(timeout=30)
            assert m.type == aiohttp.WSMsgType.TEXT
            self.pending.append(json.loads(m.data))
        raise AssertionError(f"watch of {ticket_id} did not end")

    async def wait_state(self, ticket_id: str, states: set[str], timeout: float = 400) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t = await self.ok("tickets.get", {"id": ticket_id})
            if t["state"] in states:
                return t
            await asyncio.sleep(0.5)
        raise AssertionError(f"ticket {ticket_id} never reached {states}: {t['state']} {t['error']}")


def ops_ports(run_dir: Path) -> dict[str, int]:
    st = json.loads((run_dir / "launcher.json").read_text())
    return {name: c["ops_port"] for name, c in st["children"].items()}


def fetch(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.read().decode("utf-8", "replace")


async def deliberate_failures(sweep: Sweep, rpc: Rpc, gw: str, session: aiohttp.ClientSession,
                              run_dir: Path) -> None:
    """Calls that must fail; their error texts are a sink."""
    for method, params in [("tickets.create", {"workflow": "no-such-workflow", "title": "x"}),
                           ("tickets.create", {"workflow": "ask", "workspace": "no-such-ws", "title": "x"}),
                           ("tickets.get", {"id": "no-such-ticket"}),
                           ("tickets.approve", {"id": "no-such-ticket", "sha": "0" * 40}),
                           ("no.such.method", {})]:
        doc = await rpc.call(method, params)
        assert "error" in doc, (method, doc)
        sweep.errors.append((f"rpc {method}", json.dumps(doc["error"])))
    async with session.post(gw + "/auth/login", json={"token": "wrong-token"},
                            headers={"Origin": gw.rstrip("/")}) as r:
        sweep.errors.append(("POST /auth/login (wrong token)", f"{r.status} {await r.text()}"))
    try:
        async with session.ws_connect(gw.replace("http", "ws", 1) + "rpc",
                                      headers={"Authorization": "Bearer wrong-token"}):
            pass
    except aiohttp.WSServerHandshakeError as exc:
        sweep.errors.append(("/rpc (wrong bearer)", f"{exc.status} {exc.message}"))
    # gRPC with the wrong link secret / the wrong caller
    for sock, stub_cls, call, req in [
        ("scheduler", scheduler_pb2_grpc.SchedulerStub, "ListWorkflows", scheduler_pb2.ListWorkflowsRequest()),
        ("credentials", credentials_pb2_grpc.CredentialBrokerStub, "Diff", credentials_pb2.DiffRequest()),
    ]:
        async with open_channel(str(run_dir / f"{sock}.sock"), secrets.token_bytes(32)) as ch:
            try:
                await getattr(stub_cls(ch), call)(req, timeout=10)
                sweep.errors.append((f"grpc {sock}.{call}", "UNEXPECTEDLY SUCCEEDED"))
            except grpc.aio.AioRpcError as exc:
                sweep.errors.append((f"grpc {sock}.{call}", f"{exc.code().name} {exc.details()}"))


async def scenario(sweep: Sweep, afe_proc: subprocess.Popen, out: list[str], model: FakeOpenAI,
                   ui_token: str) -> None:
    deadline = time.monotonic() + 240
    gw = None
    while time.monotonic() < deadline and gw is None:
        m = re.search(r"afe is up: open (\S+)", "".join(out))
        if m:
            gw = m.group(1)
            break
        assert afe_proc.poll() is None, "afe up exited:\n" + "".join(out)[-4000:]
        await asyncio.sleep(0.3)
    assert gw, "afe up did not come up:\n" + "".join(out)[-4000:]
    gw = gw if gw.endswith("/") else gw + "/"
    run_dir = sweep.base / "run"
    async with aiohttp.ClientSession() as session, session.ws_connect(gw.replace("http", "ws", 1) + "rpc",
                                  headers={"Authorization": f"Bearer {ui_token}"}) as ws:
        rpc = Rpc(ws)
        await deliberate_failures(sweep, rpc, gw, session, run_dir)

        async def create(workflow: str, title: str) -> str:
            t = await rpc.ok("tickets.create", {"workflow": workflow, "title": title,
                                                "body": f"{MARKER} body"})
            return t["id"]

        ids = {"demo": await create("demo-fix", "Fix add()"),
               "probe": await create("probe", "dump the sandbox"),
               "egress": await create("egress-run", "egress env")}
        if sweep.acp:
            ids["acp"] = await create("acp-code", "agent says hello")
        model.reply_text(f"Hello from the model. {MARKER}")
        ids["ask"] = await create("ask", "greeting")
        await rpc.wait_state(ids["ask"], {"succeeded", "failed", "cancelled"})
        # a model API that answers 401 and echoes the key back in its error body
        model.fail_next(401, json.dumps({"error": {"message": f"Incorrect API key provided: {model.key}"}}))
        ids["ask-401"] = await create("ask", "greeting that fails")

        demo_t = await rpc.wait_state(ids["demo"], {"waiting_approval", "failed"})
        assert demo_t["state"] == "waiting_approval", demo_t["error"]
        sweep.files_during = read_tree(sweep.base / "data")
        doc = await rpc.call("tickets.approve", {"id": ids["demo"], "sha": "1" * 40})
        sweep.errors.append(("rpc tickets.approve (wrong sha)", json.dumps(doc.get("error"))))
        await rpc.ok("tickets.approve", {"id": ids["demo"], "sha": demo_t["awaiting_sha"]})
        for name, tid in ids.items():
            sweep.tickets[name] = await rpc.wait_state(tid, {"succeeded", "failed", "cancelled"})
            sweep.events[name] = await rpc.events(tid)
            for n in sweep.tickets[name]["nodes"]:
                if n.get("error"):
                    sweep.errors.append((f"ticket {name} node {n['id']}", n["error"]))
            if sweep.tickets[name]["error"]:
                sweep.errors.append((f"ticket {name}", sweep.tickets[name]["error"]))
    # R12: every ticket is terminal now, so its sandbox, proxy and network must go
    client = docker.from_env()
    deadline = time.monotonic() + 60
    while True:
        left = [c.name for c in client.containers.list(all=True, filters={"label": f"afe.instance={sweep.instance}"})]
        left += [n.name for n in client.networks.list(filters={"label": f"afe.instance={sweep.instance}"})]
        if not left or time.monotonic() > deadline:
            sweep.leftovers = left
            break
        await asyncio.sleep(0.5)
    for name, port in ops_ports(run_dir).items():
        sweep.metrics[f"{name} /metrics"] = fetch(f"http://127.0.0.1:{port}/metrics")
        sweep.metrics[f"{name} /readyz"] = fetch(f"http://127.0.0.1:{port}/readyz")


def acp_setup() -> tuple[str | None, tuple[str, ...] | None]:
    try:
        from tests.acp.image import IMAGE, agent_command, ensure_acp_test_image
    except ImportError:
        return None, None
    ensure_acp_test_image()
    return IMAGE, agent_command("good")


@pytest.fixture(scope="module")
def sweep():
    base = temp_root("afe-cs-")
    instance = f"cs-{secrets.token_hex(4)}"
    s = Sweep(instance=instance, base=base)
    client = docker.from_env()
    acp_image, acp_command = acp_setup()
    s.acp = acp_image is not None
    values = {slot: v for slot, (_, v) in CANARIES.items()}
    receiver = OtlpReceiver().start()
    loop = asyncio.new_event_loop()
    model = FakeOpenAI(values["apiKeyEnv"])
    loop.run_until_complete(model.__aenter__())
    afe_proc = None
    pollers: list[Poller] = []
    agents: AgentWatcher | None = None
    out: list[str] = []
    try:
        cfg = demo.materialize(base / "cfg")
        (cfg / "afe.yaml").write_text(config_text(model.url, acp_image, acp_command))
        env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
        env.update({"TZ": "UTC", "OTEL_BSP_SCHEDULE_DELAY": "200",
                    **receiver.env(headers=f"x-api-key={values['OTLP headers']}", protocol="grpc")})
        for name, value in CANARIES.values():
            if name == "OTEL_EXPORTER_OTLP_HEADERS":
                continue
            if name == "AFE_DATABASE_URL":
                value = f"sqlite://afe:{value}@/{base}/data/sweep-store.db"
            env[name] = value
        argv = [sys.executable, "-m", "services.cli.main", "up", "--config", str(cfg),
                "--data", str(base / "data"), "--run", str(base / "run"), "--ops-port", "0",
                "--listen", "127.0.0.1:0", "--instance", instance, "--no-images"]
        afe_proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)

        def pump() -> None:
            for line in iter(afe_proc.stdout.readline, b""):
                out.append(line.decode("utf-8", "replace"))

        threading.Thread(target=pump, daemon=True).start()
        pollers = [Poller(lambda: snapshot_procs(s), 0.25),
                   Poller(lambda: snapshot_containers(s, client), 0.5)]
        for p in pollers:
            p.start()
        agents = AgentWatcher(base / "agent-environs")
        loop.run_until_complete(scenario(s, afe_proc, out, model, values["UI token"]))
        snapshot_containers(s, client)
    finally:
        for p in pollers:
            p.stop()
        if agents is not None:
            agents.stop(s)
        if afe_proc is not None and afe_proc.poll() is None:
            os.killpg(afe_proc.pid, signal.SIGTERM)
            try:
                afe_proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(afe_proc.pid, signal.SIGKILL)
                afe_proc.wait(10)
        s.model_requests = list(model.seen)
        loop.run_until_complete(model.__aexit__(None, None, None))
        loop.close()
        time.sleep(1.0)
        s.spans, s.otlp_requests = receiver.snapshot()
        receiver.stop()
        s.logs = "".join(out)
        artifacts = Path(os.environ.get("AFE_TEST_ARTIFACTS", ROOT / "test-artifacts"))
        artifacts.mkdir(parents=True, exist_ok=True)
        (artifacts / "canary-sweep.log").write_text(s.logs)
        s.files_after = read_tree(base / "data")
        s.store = {k: v for k, v in s.files_after.items() if "sweep-store.db" in k}
        # only this run's containers: the broker removes them at ticket end; leftovers are ours to remove
        for c in client.containers.list(all=True, filters={"label": f"afe.instance={instance}"}):
            c.remove(force=True)
        for n in client.networks.list(filters={"label": f"afe.instance={instance}"}):
            n.remove()
    yield s
    remove_temp_root(base)


def _allowed(slot: str, sink: str, item: str, sweep: Sweep) -> bool:
    return False   # nothing is allowed in any sink; the ACP value's one place is checked separately


def find(sweep: Sweep, slots=tuple(CANARIES), sinks=None, extra: dict | None = None) -> list[str]:
    """Every (canary, sink, item) where a canary shows up; each names both."""
    all_sinks = {**sweep.sinks(), **(extra or {})}
    found = []
    for sink, items in all_sinks.items():
        if sinks is not None and sink not in sinks:
            continue
        for item, data in items:
            for slot in slots:
                name, value = CANARIES[slot]
                for form, needle in forms(value).items():
                    if needle in data and not _allowed(slot, sink, item, sweep):
                        found.append(f"canary {slot} ({name}, {form}) found in {sink}: {item}")
    return found


@pytest.mark.timeout(900)
def test_r27_no_canary_in_any_sink(sweep):
    found = find(sweep)
    assert not found, "\n".join(found[:40])


@pytest.mark.timeout(900)
def test_r2_token_not_in_argv_git_config_logs_events_or_outputs(sweep):
    found = find(sweep, ("tokenEnv",))
    assert not found, "\n".join(found)
    configs = [k for k in sweep.files_during if k.endswith("config") and ".git" in k]
    assert configs, "the ticket's git config must have been searched"


@pytest.mark.timeout(900)
def test_r9_acp_value_only_inside_its_agents_environment(sweep):
    assert sweep.acp, "the ACP test image must be available"
    found = find(sweep, ("acp env",))
    assert not found, "\n".join(found)
    value = CANARIES["acp env"][1].encode()
    assert sweep.tickets["acp"]["state"] == "succeeded", sweep.tickets["acp"]["error"]
    assert any(value in env for env in sweep.agent_environs.values()), \
        f"where it belongs: its agent's environment (agents seen: {sorted(sweep.agent_environs)})"


@pytest.mark.timeout(900)
def test_r13_git_forge_and_model_secrets_never_enter_a_container(sweep):
    agents = {"agent environ " + pid: env for pid, env in sweep.agent_environs.items()}
    found = find(sweep, ("tokenEnv", "apiKeyEnv", "UI token", "OTLP headers", "store password"),
                 sinks={"docker inspect", "events", "agent environs"},
                 extra={"agent environs": list(agents.items())})
    assert not found, "\n".join(found)
    dumped = json.dumps(sweep.events["probe"])
    assert MARKER in dumped and "PATH=" in dumped, "the probe must have dumped the sandbox environment"


@pytest.mark.timeout(900)
def test_r12_sandbox_proxy_and_network_disappear_with_their_tickets(sweep):
    assert sweep.leftovers == []


@pytest.mark.timeout(900)
def test_r29_store_url_password_is_never_repeated(sweep):
    found = find(sweep, ("store password",))
    assert not found, "\n".join(found)
    assert sweep.store, "the store named by AFE_DATABASE_URL must exist"


@pytest.mark.timeout(900)
def test_sweep_positive_controls_every_sink_was_really_searched(sweep):
    """The sweep is not vacuous: each sink holds data, the non-secret marker
    reaches the sinks a ticket's text reaches, and each canary really was
    used where it belongs (so its absence elsewhere means something)."""
    sinks = sweep.sinks()
    for name in ("process logs", "store file", "events", "tickets", "/metrics and /readyz pages", "spans",
                 "docker inspect", "/proc/*/cmdline", "files during the run", "files after the run",
                 "error texts"):
        assert sinks[name] and any(d for _, d in sinks[name]), f"sink {name} is empty"
    marker = MARKER.encode()
    for name in ("store file", "events", "files during the run"):
        assert any(marker in d for _, d in sinks[name]), f"the control marker never reached {name}"
    # the demo really ran to a merge; the probe really dumped its environment
    assert sweep.tickets["demo"]["state"] == "succeeded", sweep.tickets["demo"]["error"]
    assert sweep.tickets["probe"]["state"] == "succeeded", sweep.tickets["probe"]["error"]
    assert sweep.tickets["ask"]["state"] == "succeeded", sweep.tickets["ask"]["error"]
    assert sweep.tickets["ask-401"]["state"] == "failed"
    assert any(c["Config"]["Labels"].get("afe.role") == "proxy" for c in sweep.containers.values()), \
        "the egress ticket must have had a proxy"
    # the model key reached the model API (its one legitimate destination), in the header
    auth = [r.headers.get("Authorization", "") for r in sweep.model_requests]
    assert f"Bearer {CANARIES['apiKeyEnv'][1]}" in auth
    # the OTLP headers reached the collector's export requests
    assert any(r.get("x-api-key") == CANARIES["OTLP headers"][1] for r in sweep.otlp_requests)
    # the ACP value is inside its own sandbox's agent process, and only there
    if sweep.acp:
        assert sweep.tickets["acp"]["state"] == "succeeded", sweep.tickets["acp"]["error"]
        value = CANARIES["acp env"][1].encode()
        assert any(value in env for env in sweep.agent_environs.values()), \
            f"the ACP-declared value must reach its agent's environment (agents seen: {sorted(sweep.agent_environs)})"


@pytest.mark.timeout(900)
def test_r26_one_ticket_is_one_trace_across_all_four_processes(sweep):
    """The demo ticket's spans — the gateway's JSON-RPC call, the scheduler's
    CreateTicket and ticket run, the brokers' calls — share one trace id, and
    another ticket has a trace of its own."""
    def trace_of(ticket: str) -> str:
        runs = [s for s in sweep.spans if s.name == "ticket.run"
                and s.attributes.get("afe.ticket") == sweep.tickets[ticket]["id"]]
        assert runs, f"no ticket.run span for {ticket}; services: {sorted({s.service for s in sweep.spans})}"
        return runs[0].trace_id

    demo = trace_of("demo")
    spans = [s for s in sweep.spans if s.trace_id == demo]
    services = {s.service for s in spans}
    assert services >= {"afe-gateway", "afe-scheduler", "afe-sandbox", "afe-credentials"}, sorted(services)
    names = {(s.service, s.name) for s in spans}
    assert ("afe-gateway", "rpc tickets.create") in names
    assert ("afe-scheduler", "/afe.scheduler.v1.Scheduler/CreateTicket") in names
    assert any(svc == "afe-credentials" and n.endswith("/Push") for svc, n in names)
    assert any(svc == "afe-sandbox" and n.endswith("/Exec") for svc, n in names)
    assert trace_of("probe") != demo


@pytest.mark.timeout(900)
def test_r25_metrics_pages_carry_no_ticket_id_input_path_or_host(sweep):
    pages = {k: v for k, v in sweep.metrics.items() if k.endswith("/metrics")}
    assert len(pages) == 4 and all("# TYPE" in v for v in pages.values())
    forbidden = [t["id"] for t in sweep.tickets.values()] + [MARKER, str(sweep.base), "pypi.org", "calc.py"]
    found = [f"{needle!r} in {page}" for page, text in pages.items() for needle in forbidden if needle in text]
    assert not found, found


@pytest.mark.timeout(900)
def test_metrics_pages_record_the_run(sweep):
    """Each process's families moved during the run (bounded labels only)."""
    from prometheus_client.parser import text_string_to_metric_families

    def value(page: str, name: str, **labels: str) -> float:
        total = 0.0
        for fam in text_string_to_metric_families(sweep.metrics[f"{page} /metrics"]):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    for page in ("scheduler", "sandbox", "credentials"):
        assert value(page, "afe_grpc_server_handled_total", code="OK") > 0, page
    assert value("scheduler", "afe_grpc_server_handled_total", code="PERMISSION_DENIED") >= 1
    assert value("scheduler", "afe_ticket_transitions_total", state="succeeded") >= 3
    assert value("scheduler", "afe_node_duration_seconds_count", kind="run") >= 1
    assert value("sandbox", "afe_sandbox_execs_total", outcome="ok") >= 1
    assert value("sandbox", "afe_sandbox_create_seconds_count", egress="allowlist") >= 1
    assert value("credentials", "afe_git_operations_total", op="push", outcome="ok") >= 1
    assert value("credentials", "afe_forge_calls_total", forge="local", op="open_pr", outcome="ok") >= 1
    assert value("credentials", "afe_model_calls_total", provider="openai", outcome="ok") >= 1
    assert value("credentials", "afe_model_calls_total", provider="openai", outcome="denied") >= 1   # the 401
    assert value("gateway", "afe_http_requests_total", method="GET") >= 1
