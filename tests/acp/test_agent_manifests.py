"""`afe check` refuses bad Agent manifests (R9, R28) and accepts the fixed
version of the same folder (the control that shows the refusals are caused
by the Agent documents)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)

WORKFLOW = """\
kind: Workflow
name: wf
workspace: ws
nodes:
  - id: code
    agent: coder
    prompt: "do it"
    deny: [%(deny)s]
---
kind: Workspace
name: ws
repo: %(repo)s
"""

GOOD_AGENT = """\
kind: Agent
name: coder
type: acp
command: [claude-code-acp]
env: [ACP_TEST_KEY]
image: afe/sandbox-acp-test:latest
---
"""


def afe_check(cfg: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.main", "check", "--config", str(cfg)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


def _repo(tmp: Path) -> Path:
    """A real repository with a `main` branch: `afe check` opens local repositories."""
    bare = tmp / "repo.git"
    if not bare.exists():
        env = {"PATH": "/usr/bin:/bin", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid", "HOME": str(tmp)}
        work = tmp / "work"
        for cmd in (["git", "init", "-q", "-b", "main", str(work)],
                    ["git", "-C", str(work), "commit", "-q", "--allow-empty", "-m", "init"],
                    ["git", "clone", "-q", "--bare", str(work), str(bare)]):
            subprocess.run(cmd, check=True, env=env, capture_output=True)
    return bare


def write(tmp: Path, agent: str, deny: str = "execute") -> Path:
    cfg = tmp / "cfg"
    cfg.mkdir(exist_ok=True)
    (cfg / "afe.yaml").write_text(agent + WORKFLOW % {"deny": deny, "repo": _repo(tmp)})
    return cfg


def test_a_good_agent_manifest_passes(tmp_path):
    r = afe_check(write(tmp_path, GOOD_AGENT))
    assert r.returncode == 0, r.stderr
    assert "1 agent(s)" in r.stdout


@pytest.mark.parametrize("agent, deny, needle", [
    (GOOD_AGENT.replace("command: [claude-code-acp]\n", ""), "execute", "command"),
    (GOOD_AGENT.replace("command: [claude-code-acp]", "command: []"), "execute", "command"),
    (GOOD_AGENT.replace("type: acp", "type: mcp"), "execute", "type"),
    (GOOD_AGENT.replace("image: afe", "imagez: afe"), "execute", "imagez"),
    (GOOD_AGENT, "launch_missiles", "deny"),
])
def test_afe_check_refuses_a_bad_agent_manifest(tmp_path, agent, deny, needle):
    r = afe_check(write(tmp_path, agent, deny))
    assert r.returncode == 1, r.stdout
    assert needle in r.stderr, r.stderr


@pytest.mark.parametrize("env_line", [
    "env: [sk-ant-api03-abcdefghijklmnopqrstuvwxyz012345]",
    "env: [ACP_TEST_KEY=sk-ant-api03-abcdefghijklmnopqrstuvwxyz012345]",
    "env: [ghp_abcdefghijklmnopqrstuvwxyz0123456789]",
])
def test_r28_afe_check_refuses_a_secret_value_in_agent_env(tmp_path, env_line):
    secret = env_line.split("[", 1)[1].rstrip("]").split("=")[-1]
    r = afe_check(write(tmp_path, GOOD_AGENT.replace("env: [ACP_TEST_KEY]", env_line)))
    assert r.returncode == 1, r.stdout
    assert "env" in r.stderr
    assert secret not in r.stderr and secret not in r.stdout     # the value is never echoed


REPEATED = "command: [codex-acp, -c, 'model=\"o3\"', -c, 'sandbox=\"workspace-write\"']"


def test_agent_command_keeps_repeated_items_in_order(tmp_path):
    """An argv is not a set: `-c a -c b` passes `afe check` and loads as written."""
    from services.common.config.manifests import load_config
    cfg = write(tmp_path, GOOD_AGENT.replace("command: [claude-code-acp]", REPEATED))
    r = afe_check(cfg)
    assert r.returncode == 0, r.stderr
    assert load_config(cfg).agents["coder"].command == (
        "codex-acp", "-c", 'model="o3"', "-c", 'sandbox="workspace-write"')


@pytest.mark.parametrize("agent, deny", [
    (GOOD_AGENT.replace("env: [ACP_TEST_KEY]", "env: [ACP_TEST_KEY, ACP_TEST_KEY]"), "execute"),
    (GOOD_AGENT, "execute, execute"),
])
def test_lists_meant_as_sets_still_refuse_a_repeated_item(tmp_path, agent, deny):
    """Control for the test above: only `command` gave up the duplicate check."""
    r = afe_check(write(tmp_path, agent.replace("command: [claude-code-acp]", REPEATED), deny))
    assert r.returncode == 1, r.stdout
    assert "is listed twice" in r.stderr, r.stderr
