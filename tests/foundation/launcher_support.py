"""Starting a real `afe up` (the four real processes) for the foundation tests."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common import demo
from services.common.config.manifests import load_config
from services.common.layout import Layout
from services.launcher.launch import Options, build_specs, make_links

ROOT = Path(__file__).resolve().parents[2]

CANARIES = {
    "FND_GIT_TOKEN": "canarygit" + "Q7x" * 6,            # a tokenEnv  -> credential broker only
    "FND_MODEL_KEY": "canarymodel" + "Z9k" * 6,          # an apiKeyEnv -> credential broker only
    "FND_AGENT_KEY": "canaryagent" + "W4m" * 6,          # an acp agent's env -> sandbox broker only
    "AFE_UI_TOKEN": "canaryui" + "P2v" * 8,              # the UI token -> gateway only
    "FND_UNRELATED": "canaryunrelated" + "H5j" * 6,      # named by nothing -> nobody
}
WHERE = {"FND_GIT_TOKEN": "credentials", "FND_MODEL_KEY": "credentials",
         "FND_AGENT_KEY": "sandbox", "AFE_UI_TOKEN": "gateway", "FND_UNRELATED": None}
SERVICES = ("sandbox", "credentials", "scheduler", "gateway")

CONFIG = """\
kind: Workspace
name: calc
repo: repos/calc.git
tokenEnv: FND_GIT_TOKEN
forge: {type: local}
---
kind: Model
name: remote
provider: openai
model: test-model
baseUrl: http://127.0.0.1:9/v1
apiKeyEnv: FND_MODEL_KEY
---
kind: Model
name: scripted
provider: replay
script: demo-model.yaml
---
kind: Agent
name: coder
type: acp
command: [python3, -m, coder_acp]
env: [FND_AGENT_KEY]
---
kind: Workflow
name: fix
workspace: calc
nodes:
  - {id: plan, model: remote, prompt: "plan {{ticket.title}}", tools: [read_file]}
  - {id: code, agent: coder, prompt: "implement", needs: [plan]}
  - {id: test, run: "python3 -m unittest", needs: [code]}
"""


def make_config(base: Path) -> Path:
    cfg = base / "cfg"
    demo.materialize(cfg)               # the demo repo and replay script
    (cfg / "afe.yaml").unlink()
    (cfg / "test.yaml").write_text(CONFIG)
    return cfg


def base_env(**extra: str) -> dict[str, str]:
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    env["TZ"] = "UTC"
    env["OTEL_SERVICE_NAME"] = "afe-foundation-test"
    env.update(extra)
    return env


def launch_argv(base: Path, **options: Any) -> dict[str, list[str]]:
    """Each process's argv as `afe up` with these launcher Options would start it (nothing runs)."""
    cfg = make_config(base)
    opts = Options(config_dir=cfg, layout=Layout(base / "d", base / "r"), check_images=False, **options)
    links, _ = make_links()
    return {s.service: s.argv for s in build_specs(opts, load_config(cfg), base_env(), links)}


@dataclass
class Afe:
    base: Path
    proc: subprocess.Popen
    output: list[str] = field(default_factory=list)

    @property
    def data(self) -> Path:
        return self.base / "data"

    @property
    def run_dir(self) -> Path:
        return self.base / "run"

    def state(self) -> dict | None:
        try:
            return json.loads((self.run_dir / "launcher.json").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def pids(self) -> dict[str, int]:
        st = self.state() or {"children": {}}
        return {k: v["pid"] for k, v in st["children"].items()}

    def text(self) -> str:
        return "".join(self.output)

    def wait_up(self, timeout: float = 150.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.state()
            if st and all(c["ready"] for c in st["children"].values()):
                return st
            if self.proc.poll() is not None:
                raise AssertionError(f"afe up exited with {self.proc.returncode}:\n{self.text()[-4000:]}")
            time.sleep(0.2)
        raise AssertionError(f"afe up not ready within {timeout} s:\n{self.text()[-4000:]}")

    def cli_env(self, timeout: float = 60.0) -> dict[str, str]:
        """The environment the CLI needs to reach this afe (the URL its banner prints, the UI token)."""
        deadline = time.monotonic() + timeout
        while not (m := re.search(r"^afe is up: open (\S+)", self.text(), re.MULTILINE)):
            assert time.monotonic() < deadline, self.text()[-4000:]
            time.sleep(0.2)
        return {**base_env(), "AFE_URL": m.group(1).rstrip("/"),
                "AFE_TOKEN": (self.data / "ui-token").read_text().strip()}

    def cli(self, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
        """`afe ARGS...` against this afe, as a user runs it (exit code and output kept)."""
        return subprocess.run([sys.executable, "-m", "services.cli.main", *args], check=False, cwd=ROOT,
                              env=self.cli_env(), capture_output=True, text=True, timeout=timeout)

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def start_afe(base: Path, env: dict[str, str], *extra: str, own_instance: bool = True) -> Afe:
    """`afe up` on `base`; `own_instance=False` leaves --instance out, as a user's `afe up` does."""
    cfg = base / "cfg"
    if not cfg.exists():
        make_config(base)
    instance = ["--instance", f"fnd-{secrets.token_hex(4)}"] if own_instance else []
    argv = [sys.executable, "-m", "services.cli.main", "up", "--config", str(cfg),
            "--data", str(base / "data"), "--run", str(base / "run"), "--ops-port", "0",
            "--listen", "127.0.0.1:0", *instance, "--no-images", *extra]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    afe = Afe(base, proc)

    def pump() -> None:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            afe.output.append(line.decode("utf-8", "replace"))

    threading.Thread(target=pump, daemon=True).start()
    return afe


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until every pid is gone; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    out = {}
    for entry in raw.split(b"\0"):
        if b"=" in entry:
            k, v = entry.split(b"=", 1)
            out[k.decode()] = v.decode("utf-8", "replace")
    return out


def environ_bytes(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()
