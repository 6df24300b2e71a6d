"""R43 (and R32): an Agent's `env:` never names a variable that a Model,
Workspace or McpServer holds a secret in, nor one coding tools read keys
from, with or without `preset:`; `afe check` and `afe up` refuse alike and
say what to write instead. Other names stay allowed, with a warning.

Positive control: with the refusal taken out, the README's old example
(`env: [ANTHROPIC_API_KEY]`, no preset) loads, and the real key goes to the
sandbox broker and into the sandbox spec of the agent's ticket, which hands
a declared name's value to the agent process
(tests/acp/test_r9_agent_env.py::test_r9_declared_name_reaches_the_agent_and_only_the_agent)."""

from __future__ import annotations

import re
import secrets
from pathlib import Path

import pytest
import yaml

from services.common.config.manifests import load_config
from services.common.config.presets import PRESETS
from services.common.errors import ConfigError
from services.common.layout import Layout
from services.common.schema import KINDS, sandboxenv
from services.launcher.environment import child_env
from services.scheduler.sandboxes.spec import sandbox_spec

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CANARY = "sk-ant-api03-" + secrets.token_hex(24)

BASE = """\
kind: Workspace
name: ws
repo: https://git.example.com/acme/shop.git
tokenEnv: SHOP_TOKEN
---
kind: Model
name: claude
provider: anthropic
model: claude-sonnet-4-5
apiKeyEnv: ANTHROPIC_API_KEY
---
kind: McpServer
name: tracker
url: https://mcp.tracker.example.com/mcp
tokenEnv: TRACKER_TOKEN
---
kind: Workflow
name: wf
workspace: ws
mcp: {tracker: [get_issue]}
nodes:
  - {id: code, agent: coder, prompt: "do it"}
---
"""
# The README's Agent before R43: the key by name, no preset, no relay.
OLD_README_AGENT = """\
kind: Agent
name: coder
type: acp
command: [claude-code-acp]
env: [ANTHROPIC_API_KEY]    # NAMES passed into the sandbox for this agent only
"""


def write(tmp: Path, agent: str, base: str = BASE) -> Path:
    (tmp / "afe.yaml").write_text(base + agent)
    return tmp


def refused(tmp: Path, agent: str, base: str = BASE) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp, agent, base))
    return str(info.value)


def test_r43_a_model_key_in_env_without_preset_is_refused_and_the_old_loader_let_it_into_the_sandbox(
        tmp_path, monkeypatch):
    msg = refused(tmp_path, OLD_README_AGENT)
    assert "afe.yaml#5 env: ANTHROPIC_API_KEY holds the key of Model 'claude' (apiKeyEnv)" in msg
    assert "write model: claude" in msg and "relay" in msg            # what to write instead

    # Positive control: the same folder without the refusal is what afe accepted before.
    monkeypatch.setattr(sandboxenv, "refusals", lambda loader: [])
    old = load_config(tmp_path)
    assert old.agent_env_names() == ["ANTHROPIC_API_KEY"]
    environ = {"PATH": "/usr/bin:/bin", "ANTHROPIC_API_KEY": CANARY}
    assert child_env("sandbox", old, environ)["ANTHROPIC_API_KEY"] == CANARY      # the sandbox broker holds it
    spec = sandbox_spec(old, old.workflows["wf"], old.workspaces["ws"])
    assert list(spec.env_names) == ["ANTHROPIC_API_KEY"]                          # ...and hands it in (R9)
    monkeypatch.undo()

    # The fix the error asks for: model: claude. The key stays with the credential broker.
    fixed = load_config(write(tmp_path, OLD_README_AGENT.replace(
        "env: [ANTHROPIC_API_KEY]    # NAMES passed into the sandbox for this agent only", "model: claude")))
    assert fixed.agent_env_names() == []
    assert CANARY not in child_env("sandbox", fixed, environ).values()
    assert child_env("credentials", fixed, environ)["ANTHROPIC_API_KEY"] == CANARY
    assert list(sandbox_spec(fixed, fixed.workflows["wf"], fixed.workspaces["ws"]).env_names) == []


@pytest.mark.parametrize(("name", "expected"), [
    ("ANTHROPIC_API_KEY", ("ANTHROPIC_API_KEY holds the key of Model 'claude' (apiKeyEnv); a model key never "
                          "enters the sandbox (R32, R43): remove it from env and write model: claude")),
    ("SHOP_TOKEN", ("SHOP_TOKEN holds the token of Workspace 'ws' (tokenEnv); git and forge tokens never enter "
                   "a sandbox (R13, R43): remove it from env")),
    ("TRACKER_TOKEN", ("TRACKER_TOKEN holds the credential of McpServer 'tracker' (tokenEnv); a tool's "
                      "credential never enters a sandbox (R43): remove it from env and grant the server's tools "
                      "in the Workflow (mcp: {tracker: [tool, ...]})")),
])
@pytest.mark.parametrize("preset", ["", "preset: claude-code\nmodel: claude\n"])
def test_r43_a_name_a_manifest_holds_a_secret_in_is_refused_with_or_without_preset(tmp_path, name, expected,
                                                                                    preset):
    agent = "kind: Agent\nname: coder\ntype: acp\ncommand: [x]\n" + preset
    msg = refused(tmp_path, agent + f"env: [OK_SETTING, {name}]\n")
    assert f"afe.yaml#5 env: {expected}" in msg
    assert msg.count(" env: ") == 1                       # one error, for that name only
    load_config(write(tmp_path, agent + "env: [OK_SETTING]\n"))     # control: the other name passes


@pytest.mark.parametrize(("name", "expected"), [
    ("ANTHROPIC_API_KEY", "is where coding agents read a model key"),
    ("OPENAI_API_KEY", "is where coding agents read a model key"),
    ("GEMINI_API_KEY", "is where coding agents read a model key"),
    ("CLAUDE_CODE_OAUTH_TOKEN", "is where coding agents read a model key"),
    ("GITHUB_TOKEN", "is where forge CLIs read a token"),
    ("GH_TOKEN", "is where forge CLIs read a token"),
])
def test_r43_a_known_key_name_is_refused_even_when_no_manifest_names_it(tmp_path, name, expected):
    base = BASE.replace("apiKeyEnv: ANTHROPIC_API_KEY", "apiKeyEnv: ANTHROPIC_KEY_FOR_AFE")
    msg = refused(tmp_path, OLD_README_AGENT.replace("env: [ANTHROPIC_API_KEY]", f"env: [{name}]"), base)
    assert f"afe.yaml#5 env: {name} {expected}" in msg
    assert "remove it from env" in msg


def test_r43_a_name_the_relay_sets_is_refused_without_a_preset(tmp_path):
    base = BASE.replace("apiKeyEnv: ANTHROPIC_API_KEY", "apiKeyEnv: ANTHROPIC_KEY_FOR_AFE")
    agent = "kind: Agent\nname: coder\ntype: acp\ncommand: [x]\nmodel: claude\nenv: [ANTHROPIC_BASE_URL]\n"
    msg = refused(tmp_path, agent, base)
    assert "afe.yaml#5 env: afe sets ANTHROPIC_BASE_URL itself (from the relay" in msg
    load_config(write(tmp_path, agent.replace("env: [ANTHROPIC_BASE_URL]\n", ""), base))   # control


def test_r43_afe_check_and_afe_up_refuse_alike(tmp_path, capsys):
    from services.cli.main import main
    from services.launcher.launch import Options, preflight

    (tmp_path / "cfg").mkdir()
    cfg = write(tmp_path / "cfg", OLD_README_AGENT)
    assert main(["check", "--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    line = "afe.yaml#5 env: ANTHROPIC_API_KEY holds the key of Model 'claude' (apiKeyEnv)"
    assert line in err
    opts = Options(config_dir=cfg, layout=Layout(tmp_path / "data", tmp_path / "run"), check_images=False)
    with pytest.raises(ConfigError, match=re.escape(line)):
        preflight(opts, {"PATH": "/usr/bin:/bin", "ANTHROPIC_API_KEY": CANARY, "SHOP_TOKEN": "t",
                         "TRACKER_TOKEN": "t"}, progress=lambda m: None)


def test_r43_another_name_is_allowed_and_afe_check_warns_naming_it(tmp_path, capsys):
    from services.cli.main import main

    cfg = write(tmp_path, OLD_README_AGENT.replace("[ANTHROPIC_API_KEY]", "[FOO_SETTING]"))
    assert main(["check", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "warning: agent coder: env: FOO_SETTING enters the sandbox with its value" in out
    # control: without env: no warning
    write(tmp_path, OLD_README_AGENT.replace("env: [ANTHROPIC_API_KEY]", "model: claude"))
    assert main(["check", "--config", str(cfg)]) == 0
    assert "warning:" not in capsys.readouterr().out


# ---- the examples in README.md and docs/ -----------------------------------------------------------

def _blocks() -> list[tuple[str, list[dict]]]:
    out = []
    for path in DOCS:
        for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", path.read_text(), re.DOTALL)):
            if re.search(r"^kind:", block, re.MULTILINE):   # a whole document, not an excerpt of one
                docs = [d for d in yaml.safe_load_all(block) if isinstance(d, dict) and d.get("kind") in KINDS]
                out.append((f"{path.name} yaml block {i}", docs))
    return out


def _stubs(docs: list[dict], folder: Path) -> list[dict]:
    """Documents for what an example refers to but leaves out (a Workflow's workspace, a node's
    Model, ...), so the loader checks the example itself; replay scripts as empty files."""
    have = {(d.get("kind"), d.get("name")) for d in docs}
    out: list[dict] = []

    def need(kind: str, name: object, doc: dict) -> None:
        if isinstance(name, str) and (kind, name) not in have:
            have.add((kind, name))
            out.append({"kind": kind, "name": name, **doc})

    for d in docs:
        kind = d.get("kind")
        if kind == "Workflow":
            need("Workspace", d.get("workspace"), {"repo": "https://git.example.com/a/b.git"})
            for n in d.get("nodes") or []:
                need("Model", n.get("model"), {"provider": "openai", "model": "gpt-4.1"})
                need("Agent", n.get("agent"), {"type": "acp", "command": ["agent"]})
                for t in n.get("tools") or []:
                    if t.startswith("mcp:"):
                        need("McpServer", t[4:].split("/")[0], {"url": "https://mcp.example.com/mcp"})
            for server in d.get("mcp") or {}:
                need("McpServer", server, {"url": "https://mcp.example.com/mcp"})
        elif kind == "Agent" and d.get("model"):
            provider = PRESETS[d["preset"]].providers[0] if d.get("preset") else "anthropic"
            need("Model", d["model"], {"provider": provider, "model": "m"})
        elif kind == "Trigger":
            need("Workspace", d.get("workspace"), {"repo": "https://github.com/a/b.git", "tokenEnv": "T",
                                                   "forge": {"type": "github", "repo": "a/b"}})
            need("Workflow", d.get("workflow"), {"inputs": list(d.get("inputs") or {}),
                                                 "nodes": [{"id": "a", "run": "true"}]})
        elif kind == "Model" and d.get("provider") == "replay" and isinstance(d.get("script"), str):
            (folder / d["script"]).parent.mkdir(parents=True, exist_ok=True)
            (folder / d["script"]).write_text("responses: []\n")
    return out


def _load_example(docs: list[dict], folder: Path) -> None:
    folder.mkdir()
    text = yaml.safe_dump_all([*docs, *_stubs(docs, folder)], sort_keys=False)
    (folder / "afe.yaml").write_text(text)
    load_config(folder)


def test_r43_every_manifest_example_in_the_docs_loads_without_a_refused_env_name(tmp_path):
    blocks = _blocks()
    assert len(blocks) >= 8
    held = set(sandboxenv.KNOWN_SECRET_NAMES)
    for _, docs in blocks:
        held |= {d[k] for d in docs for k in ("apiKeyEnv", "tokenEnv") if isinstance(d.get(k), str)}
    for i, (where, docs) in enumerate(blocks):
        try:
            _load_example(docs, tmp_path / f"ex{i}")
        except ConfigError as exc:
            raise AssertionError(f"{where}: {exc}") from None
        for d in docs:
            if d.get("kind") == "Agent":
                assert not set(d.get("env") or ()) & held, (where, d.get("env"))
    for path in DOCS:
        assert not re.search(r"env:\s*\[[^\]]*ANTHROPIC_API_KEY", path.read_text()), path.name


def test_r43_positive_control_the_old_readme_example_fails_the_docs_check(tmp_path):
    old = [d for d in yaml.safe_load_all(OLD_README_AGENT) if d]
    with pytest.raises(ConfigError, match="env: ANTHROPIC_API_KEY is where coding agents read a model key"):
        _load_example(old, tmp_path / "old")
