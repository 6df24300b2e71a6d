"""R33: every process afe starts gets an environment built for it.

Two halves:
- a static guard: an AST scan of services/ and gateway/ finds every process
  start (subprocess, asyncio's create_subprocess_*, os.exec*/spawn*/system,
  pty.spawn) and fails on one without an explicit `env=`; the scanner itself
  is shown to flag such calls (positive control);
- the real thing: `afe up` with a canary in every secret variable the
  manifests name, the UI token, the OTLP headers and an unrelated variable,
  while a poller reads `/proc/<pid>/environ` of every descendant of `afe up`
  (found through the ppid chain) from start-up through the image checks and a
  full demo ticket (create -> waiting_approval -> approve -> merged).

What may hold a canary (decided here, documented in docs/OPERATIONS.md):
- the launcher (`afe up`) itself: it is the user's shell, it holds all;
- each of the four services only the values its role needs (credential
  broker: git token and model key; sandbox broker: the ACP agent's declared
  variable; gateway: the UI token; every service: the OTLP headers), and only
  until it scrubs them at start (R30): after start-up none holds any;
- every other descendant (docker CLI, git, askpass, chown, shell helpers):
  nothing. The unrelated variable: nobody but the launcher.
Positive control: on its first call, the `docker` shim on PATH starts a
`sleep` with the launcher's whole environment (what every docker child got
before R33); the poller must report it.
"""

from __future__ import annotations

import ast
import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc as rpc
from services.common import demo
from services.common.rpc.grpcutil import open_channel
from services.common.secrecy.childenv import DOCKER_CLI_NAMES, docker_cli_env, proxy_env, tool_env
from tests.support.temp_roots import remove_temp_root, temp_root

from .launcher_support import ROOT, Afe, base_env, environ_bytes, wait_gone

# ---- the static guard ------------------------------------------------------------

SUBPROCESS_CALLS = {f"subprocess.{n}" for n in ("run", "Popen", "call", "check_call", "check_output")} | {
    "asyncio.create_subprocess_exec", "asyncio.create_subprocess_shell",
    "asyncio.subprocess.create_subprocess_exec", "asyncio.subprocess.create_subprocess_shell"}
LOOP_METHODS = {"subprocess_exec", "subprocess_shell"}           # loop.subprocess_exec(...)
ENV_POSITIONAL = {"os.execve": 2, "os.execvpe": 2, "os.spawnve": 3, "os.spawnvpe": 3,
                  "os.posix_spawn": 2, "os.posix_spawnp": 2}
NO_ENV_POSSIBLE = {"os.system", "os.popen", "os.execv", "os.execvp", "os.execl", "os.execlp", "os.execle",
                   "os.execlpe", "os.spawnv", "os.spawnvp", "os.spawnl", "os.spawnlp", "os.spawnle",
                   "os.spawnlpe", "pty.spawn", "subprocess.getoutput", "subprocess.getstatusoutput"}


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted origin, from the module's imports."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _dotted(expr: ast.expr, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    parts.append(aliases.get(expr.id, expr.id))
    return ".".join(reversed(parts))


def process_starts(source: str, filename: str = "<snippet>") -> list[tuple[str, int, str, bool]]:
    """Every process start in `source`: (file, line, callee, has an explicit env)."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases) or ""
        method = node.func.attr if isinstance(node.func, ast.Attribute) else ""
        if name in SUBPROCESS_CALLS or method in LOOP_METHODS:
            env = next((k.value for k in node.keywords if k.arg == "env"), None)
            ok = env is not None and not (isinstance(env, ast.Constant) and env.value is None)
        elif name in ENV_POSITIONAL:
            ok = len(node.args) > ENV_POSITIONAL[name] or any(k.arg == "env" for k in node.keywords)
        elif name in NO_ENV_POSSIBLE:
            ok = False
        else:
            continue
        found.append((filename, node.lineno, name or method, ok))
    return found


def scan_tree() -> list[tuple[str, int, str, bool]]:
    found = []
    for top in ("services", "gateway"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "_gen" in path.parts:
                continue
            found += process_starts(path.read_text(), str(path.relative_to(ROOT)))
    return found


@pytest.mark.slow
def test_r33_every_process_start_in_services_and_gateway_passes_an_explicit_env():
    found = scan_tree()
    # Not vacuous: the known starts are found (docker CLI, image builds, git, the four children).
    files = {f for f, *_ in found}
    assert {"services/common/host/images.py", "services/launcher/launch.py", "services/launcher/process_supervisor.py",
            "services/common/host/gitcmd.py"} <= files, files
    bad = [f"{f}:{line} {name}" for f, line, name, ok in found if not ok]
    assert not bad, ("these start a process that inherits this process's environment; pass env= built "
                     "with services/common/secrecy/childenv.py (R33):\n" + "\n".join(bad))


SNIPPETS_WITHOUT_ENV = [
    "import subprocess\nsubprocess.run(['docker', 'version'])",
    "import subprocess as sp\nsp.Popen(['git'], stdout=sp.PIPE)",
    "from subprocess import check_output\ncheck_output(['ls'])",
    "import subprocess\nsubprocess.run(['x'], env=None)",
    "import subprocess\nsubprocess.run(['x'], **kw)",
    "import asyncio\nasync def f():\n    await asyncio.create_subprocess_exec('git', 'status')",
    "async def f(loop):\n    await loop.subprocess_exec(proto, 'sleep', '1')",
    "import os\nos.system('id')",
    "import os\nos.execv('/bin/sh', ['sh'])",
    "import os\nos.execve('/bin/sh', ['sh'])",
    "import pty\npty.spawn(['sh'])",
]
SNIPPETS_WITH_ENV = [
    "import subprocess\nsubprocess.run(['docker', 'version'], env={'PATH': '/usr/bin'})",
    "import asyncio\nasync def f(e):\n    await asyncio.create_subprocess_exec('git', env=e)",
    "import os\nos.execve('/bin/sh', ['sh'], {'PATH': '/bin'})",
]


@pytest.mark.parametrize("source", SNIPPETS_WITHOUT_ENV)
def test_r33_scanner_flags_a_process_start_without_env(source):
    """Positive control of the guard above."""
    found = process_starts(source)
    assert found and not any(ok for *_, ok in found), found


@pytest.mark.parametrize("source", SNIPPETS_WITH_ENV)
def test_r33_scanner_accepts_a_process_start_with_env(source):
    found = process_starts(source)
    assert found and all(ok for *_, ok in found), found


def test_r33_tool_environments_are_allowlists():
    outside = {"PATH": "/x/bin:/usr/bin", "HOME": "/root", "LANG": "C.UTF-8", "TZ": "UTC",
               "DOCKER_HOST": "unix:///d.sock", "DOCKER_CONFIG": "/cfg", "GH_TOKEN": "t",
               "OTEL_EXPORTER_OTLP_HEADERS": "k=v", "https_proxy": "http://p:3128", "NO_PROXY": "corp",
               "RANDOM_THING": "r"}
    assert docker_cli_env(outside) == {k: outside[k] for k in
                                       ("PATH", "HOME", "LANG", "TZ", "DOCKER_HOST", "DOCKER_CONFIG")}
    assert set(tool_env(environ={"GH_TOKEN": "t"})) == {"PATH"}     # PATH always set, nothing else
    assert proxy_env(outside) == {"https_proxy": "http://p:3128", "NO_PROXY": "corp"}
    assert "DOCKER_HOST" in DOCKER_CLI_NAMES


# ---- the live run -------------------------------------------------------------------

CANARY = {name: f"r33{tag}{secrets.token_hex(12)}" for name, tag in [
    ("R33_GIT_TOKEN", "git"), ("R33_MODEL_KEY", "model"), ("R33_AGENT_KEY", "agent"),
    ("AFE_UI_TOKEN", "ui"), ("OTEL_EXPORTER_OTLP_HEADERS", "otlp"), ("R33_EXTRA", "extra")]}
SERVICE_MODULES = {"services.sandbox.main": "sandbox", "services.credentials.main": "credentials",
                   "services.scheduler.main": "scheduler", "gateway.main": "gateway"}
ALLOWED = {   # what each service may hold until its start-up scrub (R30)
    "credentials": {"R33_GIT_TOKEN", "R33_MODEL_KEY", "OTEL_EXPORTER_OTLP_HEADERS"},
    "sandbox": {"R33_AGENT_KEY", "OTEL_EXPORTER_OTLP_HEADERS"},
    "gateway": {"AFE_UI_TOKEN", "OTEL_EXPORTER_OTLP_HEADERS"},
    "scheduler": {"OTEL_EXPORTER_OTLP_HEADERS"},
}
CONTROL_ARG = "3.3033"          # argv of the control `sleep`, so it can be told apart

CONFIG = """\
kind: Workspace
name: demo
repo: repos/calc.git
baseBranch: main
tokenEnv: R33_GIT_TOKEN
forge: {type: local}
sandbox: {image: afe/sandbox:latest, limits: {cpus: 1, memory: 512m, pids: 256}}
---
kind: Model
name: demo-model
provider: replay
script: demo-model.yaml
---
kind: Model
name: remote
provider: openai
model: unused
baseUrl: http://127.0.0.1:9/v1
apiKeyEnv: R33_MODEL_KEY
---
kind: Agent
name: coder
type: acp
command: [python3, -m, coder_acp]
env: [R33_AGENT_KEY]
---
kind: Workflow
name: demo-fix
workspace: demo
nodes:
  - {id: fix, model: demo-model, prompt: "Fix the failing test. {{ticket.title}}", tools: [read_file, write_file, list_dir, run], max_turns: 8}
  - {id: test, run: "python3 -m unittest -v", needs: [fix], timeout: 120}
  - {id: pr, uses: "builtin:open_pr", needs: [test]}
  - {id: merge, uses: "builtin:merge", needs: [pr]}
"""

SHIM = """#!/bin/sh
# The docker CLI, held {hold} s per call so the /proc poller sees every call.
if mkdir {lock} 2>/dev/null; then
  # Positive control: a descendant with the launcher's WHOLE environment, as
  # every child of afe up had before R33.
  xargs -0 -a /proc/$PPID/environ sh -c 'exec env -i "$@" sleep {arg}' sh
fi
sleep {hold}
exec {docker} "$@"
"""


@dataclass
class Hit:
    pid: int
    ppid: int
    cmdline: str
    names: frozenset[str]


@dataclass(eq=False)
class TreePoller(threading.Thread):
    """Reads the environ of every descendant of `root` until stopped."""

    root: int
    hits: list[Hit] = field(default_factory=list)
    seen: dict[int, str] = field(default_factory=dict)       # pid -> cmdline of every descendant seen
    sweeps: int = 0
    stop_event: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        super().__init__(daemon=True)

    @staticmethod
    def parents() -> dict[int, int]:
        out = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    stat = Path(f"/proc/{d}/stat").read_text()
                except OSError:
                    continue
                out[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
        return out

    def descendants(self) -> dict[int, int]:
        ppid = self.parents()
        found: dict[int, int] = {}
        for pid in ppid:
            p, chain = pid, 0
            while p > 1 and chain < 64:
                if p == self.root:
                    found[pid] = ppid[pid]
                    break
                p, chain = ppid.get(p, 0), chain + 1
        return found

    def sweep(self) -> None:
        for pid, ppid in self.descendants().items():
            try:
                raw = environ_bytes(pid)
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            except OSError:
                continue
            self.seen.setdefault(pid, cmd)
            names = frozenset(n for n, v in CANARY.items() if v.encode() in raw)
            if names:
                self.hits.append(Hit(pid, ppid, cmd, names))
        self.sweeps += 1

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sweep()
            time.sleep(0.005)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(10)


def role(hit: Hit, root: int, root_cmdline: str = "") -> str:
    if hit.pid == root:
        return "launcher"
    if hit.ppid == root and root_cmdline and hit.cmdline.strip() == root_cmdline:
        # fork() before exec(): still the launcher's own image and memory, for
        # the moment until exec() replaces them with the child's.
        return "launcher"
    if hit.ppid == root:
        for module, service in SERVICE_MODULES.items():
            if f" -m {module} " in f" {hit.cmdline} ":
                return service
    return "other"


async def drive_demo_ticket(run_dir: Path) -> list[str]:
    key = bytes.fromhex((run_dir / "automation.key").read_text().strip())
    seen: list[str] = []
    async with open_channel(str(run_dir / "scheduler.sock"), key) as ch:
        stub = rpc.SchedulerStub(ch)
        t = await stub.CreateTicket(pb.CreateTicketRequest(workspace="demo", workflow="demo-fix",
                                                           title="add() subtracts", principal="r33-test"))
        deadline = time.monotonic() + 240
        approved = False
        while time.monotonic() < deadline:
            t = await stub.GetTicket(pb.GetTicketRequest(id=t.id))
            state = pb.TicketState.Name(t.state)
            if not seen or seen[-1] != state:
                seen.append(state)
            if "WAITING" in state and not approved:
                await stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="r33-test"))
                approved = True
            if state.endswith(("SUCCEEDED", "FAILED", "CANCELLED")):
                assert state.endswith("SUCCEEDED") and t.pr.state == "merged", (seen, t.error)
                return seen
            await asyncio.sleep(0.3)
    raise AssertionError(f"the demo ticket did not finish; states: {seen}")


@pytest.mark.docker
@pytest.mark.timeout(360)
def test_r33_no_secret_reaches_any_descendant_of_afe_up_but_its_holder():
    base = temp_root("afe-r33-")
    cfg = base / "cfg"
    demo.materialize(cfg)
    (cfg / "afe.yaml").write_text(CONFIG)
    shim_dir = base / "shim"
    shim_dir.mkdir()
    docker = shutil.which("docker")
    assert docker, "the docker CLI is needed"
    (shim_dir / "docker").write_text(SHIM.format(hold="0.4", lock=base / "control.lock", arg=CONTROL_ARG,
                                                 docker=docker))
    (shim_dir / "docker").chmod(0o755)
    env = base_env(**CANARY)
    env["OTEL_EXPORTER_OTLP_HEADERS"] = f"x-api-key={CANARY['OTEL_EXPORTER_OTLP_HEADERS']}"
    env["PATH"] = f"{shim_dir}:{env.get('PATH', '/usr/bin:/bin')}"
    # No --no-images: the start-up image checks (docker version, docker image inspect) run too.
    argv = [sys.executable, "-m", "services.cli.main", "up", "--config", str(cfg), "--data", str(base / "data"),
            "--run", str(base / "run"), "--ops-port", "0", "--listen", "127.0.0.1:0",
            "--instance", f"r33-{secrets.token_hex(3)}"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    afe = Afe(base, proc)
    poller = TreePoller(proc.pid)

    def pump() -> None:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            afe.output.append(line.decode("utf-8", "replace"))

    threading.Thread(target=pump, daemon=True).start()
    pids: list[int] = []
    try:
        poller.start()
        afe.wait_up()
        pids = list(afe.pids().values())
        states = asyncio.run(drive_demo_ticket(base / "run"))
        assert any("WAITING" in s for s in states), states
        # After start-up every service has scrubbed what it was handed (R30).
        for name, pid in afe.pids().items():
            raw = environ_bytes(pid)
            assert not [n for n, v in CANARY.items() if v.encode() in raw], f"{name} still holds a canary"
    finally:
        poller.stop()
        code = afe.stop()
        wait_gone(pids, 10)
        remove_temp_root(base)
    assert code == 0, afe.text()[-3000:]

    control = [h for h in poller.hits if h.cmdline.strip() == f"sleep {CONTROL_ARG}"]
    # Positive control: the poller finds a child that inherited the launcher's environment, every canary in it.
    assert control and set().union(*(h.names for h in control)) == set(CANARY), control
    cmdlines = list(poller.seen.values())
    assert sum("docker" in c for c in cmdlines) >= 4, cmdlines      # version + 3 image inspects were seen
    leaks = []
    for hit in poller.hits:
        if hit in control:
            continue
        who = role(hit, proc.pid, " ".join(argv))
        if who == "launcher":
            continue
        extra = hit.names - ALLOWED.get(who, set())
        if extra:
            leaks.append(f"{sorted(extra)} in pid {hit.pid} ({who}): {hit.cmdline[:160]}")
    assert not leaks, "canaries outside their holder:\n" + "\n".join(dict.fromkeys(leaks))
    print(f"R33 poller: {poller.sweeps} sweeps, {len(poller.seen)} descendants seen; git processes seen: "
          f"{sum(c.startswith('git ') for c in cmdlines)}")
