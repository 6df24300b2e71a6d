"""Manifests of the model relay (R32): an Agent's `model` and `relayEnv`,
the gemini provider, max_tokens on agent nodes, and the default variables
each provider's agent gets."""

from __future__ import annotations

import pytest

from services.common.config.manifests import load_config
from services.common.errors import ConfigError
from services.common.relayenv import relay_env

BASE = """\
kind: Workspace
name: ws
repo: https://github.com/o/r
tokenEnv: GH_TOKEN
---
kind: Model
name: claude
provider: anthropic
model: claude-x
apiKeyEnv: ANTHROPIC_KEY
---
kind: Model
name: gem
provider: gemini
model: gemini-x
apiKeyEnv: GEMINI_KEY
---
kind: Model
name: scripted
provider: replay
script: script.yaml
---
kind: Workflow
name: wf
workspace: ws
maxTokens: 1000
nodes:
  - {id: a, agent: coder, prompt: go, max_tokens: 300}
---
"""


def load(tmp_path, agent: str, extra: str = ""):
    (tmp_path / "script.yaml").write_text("[]\n")
    (tmp_path / "afe.yaml").write_text(BASE + agent + extra)
    return load_config(tmp_path)


def errors(tmp_path, agent: str, extra: str = "") -> str:
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, agent, extra)
    return str(exc.value)


def test_agent_with_model_and_relay_env_loads(tmp_path):
    cfg = load(tmp_path, "kind: Agent\nname: coder\ntype: acp\ncommand: [x]\nmodel: claude\n"
                         "relayEnv: {MY_URL: '{base_url}/v1', MY_KEY: '{capability}', MY_MODEL: '{model}'}\n")
    a = cfg.agents["coder"]
    assert a.model == "claude" and dict(a.relay_env)["MY_URL"] == "{base_url}/v1"
    assert cfg.workflows["wf"].nodes[0].max_tokens == 300
    env = relay_env(a.relay_env, provider="anthropic", model_name="claude", model_id="claude-x", capability="c")
    assert env == {"MY_URL": "http://127.0.0.1:7480/m/claude/v1", "MY_KEY": "c", "MY_MODEL": "claude-x"}


@pytest.mark.parametrize("provider,expected", [
    ("anthropic", {"ANTHROPIC_BASE_URL": "http://127.0.0.1:7480/m/m", "ANTHROPIC_API_KEY": "c"}),
    ("openai", {"OPENAI_BASE_URL": "http://127.0.0.1:7480/m/m/v1", "OPENAI_API_KEY": "c"}),
    ("gemini", {"GOOGLE_GEMINI_BASE_URL": "http://127.0.0.1:7480/m/m", "GEMINI_API_KEY": "c"}),
])
def test_default_relay_env_per_provider(provider, expected):
    assert relay_env((), provider=provider, model_name="m", model_id="x", capability="c") == expected


@pytest.mark.parametrize("agent,message", [
    ("model: nope\n", "no Model named 'nope'"),
    ("model: scripted\n", "has provider replay"),
    ("model: claude\nrelayEnv: {K: '{key}'}\n", "uses {key}"),
    ("model: claude\nrelayEnv: {K: '{base_url'}\n", "not a valid template"),
    ("model: claude\nenv: [K]\nrelayEnv: {K: '{capability}'}\n", "also in env"),
    ("relayEnv: {K: '{capability}'}\n", "only an agent with model:"),
    ("model: claude\nrelayEnv: {lower: '{capability}'}\n", "names an environment variable"),
])
def test_bad_relay_manifests_say_what_to_change(tmp_path, agent, message):
    assert message in errors(tmp_path, "kind: Agent\nname: coder\ntype: acp\ncommand: [x]\n" + agent)


def test_gemini_model_cannot_drive_a_model_node(tmp_path):
    text = errors(tmp_path, "kind: Agent\nname: coder\ntype: acp\ncommand: [x]\n",
                  "---\nkind: Workflow\nname: wf2\nworkspace: ws\nnodes:\n  - {id: m, model: gem, prompt: hi}\n")
    assert "only agents can use" in text
