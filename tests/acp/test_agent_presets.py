"""Agent presets in the manifests (services/common/config/presets.py): `preset:`
expands into image, command, relay wiring and fixed settings unless the
manifest writes them by hand; `fixedEnv` never holds a secret; a bad preset
names the field and lists the valid ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config.manifests import load_config
from services.common.config.presets import PRESETS, check_fixed_env
from services.common.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

BASE = """\
kind: Workspace
name: ws
repo: /tmp/nowhere.git
---
kind: Model
name: claude
provider: anthropic
model: claude-sonnet-4
apiKeyEnv: ANTHROPIC_KEY_FOR_AFE
---
kind: Model
name: gpt
provider: openai
model: gpt-5
apiKeyEnv: OPENAI_KEY_FOR_AFE
---
kind: Model
name: gem
provider: gemini
model: gemini-2.5-pro
apiKeyEnv: GEMINI_KEY_FOR_AFE
---
kind: Workflow
name: wf
workspace: ws
nodes:
  - id: code
    agent: coder
    prompt: "do it"
---
"""


def load(tmp_path: Path, agent: str):
    cfg = tmp_path / "cfg"
    cfg.mkdir(exist_ok=True)
    (cfg / "afe.yaml").write_text(BASE + agent)
    return load_config(cfg)


def errors(tmp_path: Path, agent: str) -> str:
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, agent)
    return str(exc.value)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_expands_image_command_relay_and_fixed_env(tmp_path, name):
    p = PRESETS[name]
    model = {"anthropic": "claude", "openai": "gpt", "gemini": "gem"}[p.providers[0]]
    a = load(tmp_path, f"kind: Agent\nname: coder\ntype: acp\npreset: {name}\nmodel: {model}\n").agents["coder"]
    assert a.preset == name
    assert a.image == p.image == f"afe/agent-{name}:{p.version}"
    assert a.command == p.command and a.command
    assert a.relay_env == p.relay_env
    assert a.fixed_env == p.fixed_env
    assert a.env == ()                                   # no variable of the broker enters the sandbox
    assert (p.context_dir / "package-lock.json").is_file() and (p.context_dir / "Dockerfile").is_file()
    assert f'"{p.package}": "{p.version}"' in (p.context_dir / "package.json").read_text()


def test_hand_written_fields_win_over_the_preset(tmp_path):
    a = load(tmp_path, """\
kind: Agent
name: coder
type: acp
preset: codex
model: gpt
image: my/codex:1
command: [codex-acp, -c, model="o4"]
relayEnv: {OPENAI_BASE_URL: "{base_url}/v1", OPENAI_API_KEY: "{capability}", EXTRA_URL: "{base_url}"}
fixedEnv: {CODEX_HOME: /workspace/.codex, RUST_LOG: warn, VERBOSE: 1}
""").agents["coder"]
    assert a.image == "my/codex:1"
    assert a.command == ("codex-acp", "-c", 'model="o4"')
    assert dict(a.relay_env)["EXTRA_URL"] == "{base_url}"
    assert dict(a.fixed_env) == {"CODEX_HOME": "/workspace/.codex", "RUST_LOG": "warn", "VERBOSE": "1"}


def test_without_preset_command_is_still_required_and_nothing_is_added(tmp_path):
    msg = errors(tmp_path, "kind: Agent\nname: coder\ntype: acp\n")
    assert "afe.yaml#6 command: required field is missing" in msg
    a = load(tmp_path, "kind: Agent\nname: coder\ntype: acp\ncommand: [my-agent]\n").agents["coder"]
    assert (a.preset, a.image, a.relay_env, a.fixed_env) == (None, None, (), ())


def test_unknown_preset_names_the_field_and_lists_the_presets(tmp_path):
    msg = errors(tmp_path, "kind: Agent\nname: coder\ntype: acp\npreset: cursor\n")
    assert "afe.yaml#6 preset: 'cursor' is not one of: claude-code, codex, gemini, opencode" in msg


@pytest.mark.parametrize(("entry", "expected"), [
    ("MY_API_KEY: hello", "fixedEnv.MY_API_KEY: the name MY_API_KEY reads like a secret's"),
    ("GITHUB_TOKEN: x", "fixedEnv.GITHUB_TOKEN: the name GITHUB_TOKEN reads like a secret's"),
    ("OPENAI_AUTH: x", "fixedEnv.OPENAI_AUTH: the name OPENAI_AUTH reads like a secret's"),
    ("SETTING: sk-ant-api03-" + "a" * 40, "looks like a secret"),
    ("SETTING: ghp_" + "A" * 36, "looks like a secret"),
    ("lower: x", "fixedEnv: a key is not an environment variable name"),
    ("SETTING: [a, b]", "fixedEnv.SETTING: must be a text value"),
    ('SETTING: "a\\nb"', "fixedEnv.SETTING: the value holds a control character"),
    ("ANTHROPIC_BASE_URL: http://x", "fixedEnv.ANTHROPIC_BASE_URL: ANTHROPIC_BASE_URL is also in relayEnv"),
])
def test_r28_fixed_env_refuses_secrets_and_bad_entries(tmp_path, entry, expected):
    agent = ("kind: Agent\nname: coder\ntype: acp\ncommand: [a]\nmodel: claude\n"
             "relayEnv: {ANTHROPIC_BASE_URL: '{base_url}'}\nfixedEnv:\n  " + entry + "\n")
    msg = errors(tmp_path, agent)
    assert expected in msg
    assert "sk-ant-api03-" not in msg and "ghp_" not in msg          # never echoed
    # control: the same document with a plain entry loads
    ok = agent.replace(entry, "SETTING: plain")
    assert dict(load(tmp_path, ok).agents["coder"].fixed_env) == {"SETTING": "plain"}


def test_r32_preset_refuses_a_model_key_passed_by_name(tmp_path):
    msg = errors(tmp_path, "kind: Agent\nname: coder\ntype: acp\npreset: claude-code\nmodel: claude\n"
                           "env: [ANTHROPIC_API_KEY]\n")
    assert "afe.yaml#6 env: preset claude-code sets ANTHROPIC_API_KEY itself" in msg


def test_every_preset_fixed_value_passes_its_own_check():
    for p in PRESETS.values():
        for k, v in p.fixed_env:
            assert check_fixed_env(k, v) is None, (p.name, k)
        assert all(k not in dict(p.fixed_env) for k, _ in p.relay_env)


def test_images_build_names_the_presets_for_an_unknown_agent():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "services.cli.main", "images", "build", "--agent", "cursor"],
                       cwd=root, capture_output=True, text=True, timeout=60, check=False,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})
    assert r.returncode == 1
    assert r.stderr.strip() == ("afe images build: no agent preset named 'cursor'; presets: claude-code, codex, "
                                "gemini, opencode")


def test_preset_and_model_provider_must_match(tmp_path):
    msg = errors(tmp_path, "kind: Agent\nname: coder\ntype: acp\npreset: codex\nmodel: claude\n")
    assert ("afe.yaml#6 model: preset codex talks to openai models, but Model 'claude' has provider anthropic; "
            "name a Model of provider openai or choose the preset of that provider") in msg
    # control: the anthropic preset with the same Model loads
    assert load(tmp_path, "kind: Agent\nname: coder\ntype: acp\npreset: claude-code\nmodel: claude\n"
                ).agents["coder"].model == "claude"
