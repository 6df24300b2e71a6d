"""R9: a ticket's sandbox receives the env NAMES of the agents its workflow
uses, and only those; the rest of the spec is the workspace's sandbox."""

from __future__ import annotations

from services.common.config.manifests import load_config
from services.scheduler.executor import sandbox_spec
from tests.scheduler.conftest import write_config

CONFIG = """\
kind: Agent
name: used
type: acp
command: [used-agent]
env: [USED_AGENT_KEY]
---
kind: Agent
name: unused
type: acp
command: [other-agent]
env: [UNUSED_AGENT_KEY]
---
kind: Workflow
name: with-agent
workspace: ws
nodes:
  - {id: code, agent: used, prompt: "do it"}
---
kind: Workflow
name: no-agent
workspace: ws
nodes:
  - {id: test, run: "true"}
"""


def test_r9_only_the_workflows_agents_env_names_reach_the_sandbox(tmp_path):
    cfg = load_config(write_config(tmp_path, CONFIG, sandbox_extra="  egress: [pypi.org]\n"))
    ws = cfg.workspaces["ws"]
    spec = sandbox_spec(cfg, cfg.workflows["with-agent"], ws)
    assert list(spec.env_names) == ["USED_AGENT_KEY"]
    # Positive control: the config does declare the other name, for another agent.
    assert "UNUSED_AGENT_KEY" in cfg.agent_env_names()
    assert list(sandbox_spec(cfg, cfg.workflows["no-agent"], ws).env_names) == []
    assert list(spec.egress) == ["pypi.org"] and spec.image == ws.sandbox.image
    assert spec.limits.memory_bytes == 256 * 1024 * 1024 and spec.limits.pids == 128


def test_sandbox_runtime_reaches_the_spec_and_the_ticket_and_runc_keeps_the_profile_unchanged(tmp_path):
    from services.scheduler.sandboxes.pool import profile_key

    gv = load_config(write_config(tmp_path / "g", CONFIG, sandbox_extra="  runtime: gvisor\n"))
    plain = load_config(write_config(tmp_path / "p", CONFIG))
    explicit = load_config(write_config(tmp_path / "r", CONFIG, sandbox_extra="  runtime: runc\n"))
    assert gv.workspaces["ws"].sandbox.runtime == "gvisor" and plain.workspaces["ws"].sandbox.runtime == "runc"
    assert sandbox_spec(gv, gv.workflows["no-agent"], gv.workspaces["ws"]).runtime == "gvisor"
    assert sandbox_spec(plain, plain.workflows["no-agent"], plain.workspaces["ws"]).runtime == ""
    # a gVisor sandbox is its own warm-pool profile; runc's (explicit or default) is the one it always was
    keys = {name: profile_key(c, c.workspaces["ws"], c.workflows["no-agent"])
            for name, c in (("gvisor", gv), ("default", plain), ("runc", explicit))}
    assert keys["default"] == keys["runc"] != keys["gvisor"]


def test_afe_check_names_a_sandbox_runtime_it_does_not_know(tmp_path):
    from services.common.errors import ConfigError

    try:
        load_config(write_config(tmp_path, CONFIG, sandbox_extra="  runtime: kata\n"))
    except ConfigError as exc:
        assert "sandbox.runtime" in str(exc) and "runc, gvisor" in str(exc)
    else:
        raise AssertionError("runtime: kata was accepted")
