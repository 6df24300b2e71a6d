"""Manifest validation (DESIGN §2, R27, R28): every refusal names file, document
and field and says what to change; a secret-looking value is never echoed."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from services.common import demo
from services.common.config.manifests import load_config, missing_env, parse_memory
from services.common.errors import ConfigError

WORKSPACE = """\
kind: Workspace
name: shop
repo: repos/shop.git
"""
MODEL = """\
kind: Model
name: m
provider: replay
script: scripts/script.yaml
"""
AGENT = """\
kind: Agent
name: coder
type: acp
command: [coder-acp, --stdio]
env: [CODER_KEY]
"""
WORKFLOW = """\
kind: Workflow
name: wf
workspace: shop
nodes:
  - {id: plan, model: m, prompt: "plan {{ticket.title}}", tools: [read_file, list_dir]}
  - {id: code, agent: coder, prompt: "do it", needs: [plan], deny: [fetch]}
  - {id: test, run: "pytest -q", needs: [code], timeout: 600}
  - {id: pr, uses: "builtin:open_pr", needs: [test], with: {title: "Fix"}}
  - {id: merge, uses: "builtin:merge", needs: [pr]}
"""
GOOD = f"{WORKSPACE}---\n{MODEL}---\n{AGENT}---\n{WORKFLOW}"


def write(tmp: Path, text: str, name: str = "afe.yaml") -> Path:
    (tmp / name).write_text(textwrap.dedent(text))
    (tmp / "scripts").mkdir(exist_ok=True)
    (tmp / "scripts" / "script.yaml").write_text("responses:\n  - content: done\n")
    return tmp


def errors_of(tmp: Path, text: str) -> str:
    write(tmp, text)
    with pytest.raises(ConfigError) as info:
        load_config(tmp)
    return str(info.value)


def test_good_config_loads_with_resolved_paths(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.workspaces["shop"].repo == str((tmp_path / "repos/shop.git").resolve())
    assert cfg.models["m"].script == (tmp_path / "scripts/script.yaml").resolve()
    assert cfg.agents["coder"].env == ("CODER_KEY",)
    wf = cfg.workflows["wf"]
    assert [n.kind for n in wf.nodes] == ["model", "agent", "run", "builtin", "builtin"]
    assert wf.node("pr").with_ == {"title": "Fix"}
    assert wf.node("test").timeout_s == 600
    assert cfg.agent_env_names() == ["CODER_KEY"]


def test_bundled_demo_validates(tmp_path):
    cfg = load_config(demo.materialize(tmp_path / "demo"))
    assert set(cfg.workflows) == {"demo-fix"}
    assert Path(cfg.workspaces["demo"].repo, "HEAD").exists()


def test_memory_sizes():
    assert parse_memory("512m") == 512 * 1024 ** 2
    assert parse_memory("2g") == 2 * 1024 ** 3
    assert parse_memory("1.5GiB") == int(1.5 * 1024 ** 3)
    assert parse_memory(1048576) == 1048576
    assert parse_memory("lots") is None
    assert parse_memory(True) is None


# (case id, manifest text, expected fragment of the error line)
REFUSALS = [
    ("unknown-kind", "kind: Gadget\nname: x\n", "afe.yaml#1 kind: unknown kind 'Gadget'"),
    ("missing-kind", "name: x\n", "afe.yaml#1 kind: required field is missing"),
    ("unknown-field", WORKSPACE + "colour: red\n", "afe.yaml#1 colour: unknown field 'colour'"),
    ("unknown-nested-field", WORKSPACE + "sandbox: {limits: {gpus: 1}}\n",
     "sandbox.limits.gpus: unknown field"),
    ("missing-required", "kind: Workspace\nname: x\n", "afe.yaml#1 repo: required field is missing"),
    ("missing-name", "kind: Agent\ntype: acp\ncommand: [x]\n", "afe.yaml#1 name: required field is missing"),
    ("duplicate-name", WORKSPACE + "---\n" + WORKSPACE,
     "afe.yaml#2 name: a Workspace named 'shop' is already defined at afe.yaml#1"),
    ("duplicate-node-id", WORKSPACE + "---\nkind: Workflow\nname: w\nnodes:\n  - {id: a, run: x}\n"
     "  - {id: a, run: y}\n", "afe.yaml#2 nodes[1].id: node id 'a' is used twice"),
    ("dangling-workspace", "kind: Workflow\nname: w\nworkspace: nope\nnodes: [{id: a, run: x}]\n",
     "afe.yaml#1 workspace: no Workspace named 'nope'"),
    ("dangling-model", "kind: Workflow\nname: w\nnodes: [{id: a, model: ghost, prompt: p}]\n",
     "afe.yaml#1 nodes[0].model: no Model named 'ghost'"),
    ("dangling-agent", "kind: Workflow\nname: w\nnodes: [{id: a, agent: ghost, prompt: p}]\n",
     "afe.yaml#1 nodes[0].agent: no Agent named 'ghost'"),
    ("dangling-needs", "kind: Workflow\nname: w\nnodes: [{id: a, run: x, needs: [zz]}]\n",
     "afe.yaml#1 nodes[0].needs: 'zz' is not a node id"),
    ("cycle", ("kind: Workflow\nname: w\nnodes:\n  - {id: a, run: x, needs: [c]}\n"
     "  - {id: b, run: x, needs: [a]}\n  - {id: c, run: x, needs: [b]}\n"),
     "afe.yaml#1 nodes: dependency cycle a -> c -> b -> a"),
    ("self-need", "kind: Workflow\nname: w\nnodes: [{id: a, run: x, needs: [a]}]\n",
     "a node cannot need itself"),
    ("bad-memory", WORKSPACE + "sandbox: {limits: {memory: lots}}\n",
     "sandbox.limits.memory: 'lots' is not a size"),
    ("negative-cpus", WORKSPACE + "sandbox: {limits: {cpus: -1}}\n", "sandbox.limits.cpus: must be greater"),
    ("zero-pids", WORKSPACE + "sandbox: {limits: {pids: 0}}\n", "sandbox.limits.pids: must be at least 1"),
    ("tiny-memory", WORKSPACE + "sandbox: {limits: {memory: 1k}}\n", "below Docker's minimum"),
    ("egress-url", WORKSPACE + "sandbox: {egress: ['https://pypi.org/simple']}\n", "sandbox.egress[0]"),
    ("egress-ip", WORKSPACE + "sandbox: {egress: [10.0.0.1]}\n", "is an IP address"),
    ("bad-env-name", WORKSPACE + "tokenEnv: my-token\n", "afe.yaml#1 tokenEnv: 'my-token' is not valid"),
    ("bad-agent-env", AGENT.replace("CODER_KEY", "lower"), "env[0]: 'lower' is not valid"),
    ("http-remote", "kind: Workspace\nname: x\nrepo: http://git.example/a.git\n", "only https:// remotes"),
    ("ssh-remote", "kind: Workspace\nname: x\nrepo: ssh://git.example/a.git\n", "only https:// remotes"),
    ("userinfo", "kind: Workspace\nname: x\nrepo: https://bob@git.example/a.git\n",
     "must not hold credentials"),
    ("scp-remote", "kind: Workspace\nname: x\nrepo: git@github.com:a/b.git\n", "must not hold credentials"),
    ("two-node-kinds", "kind: Workflow\nname: w\nnodes: [{id: a, run: x, uses: 'builtin:merge'}]\n",
     "a node needs exactly one of"),
    ("no-node-kind", "kind: Workflow\nname: w\nnodes: [{id: a}]\n", "it has none"),
    ("bad-builtin", "kind: Workflow\nname: w\nnodes: [{id: a, uses: 'builtin:deploy'}]\n",
     "'builtin:deploy' is not a builtin"),
    ("bad-tool", "kind: Workflow\nname: w\nnodes: [{id: a, model: m, prompt: p, tools: [shell]}]\n"
     "---\n" + MODEL, "tools[0]: 'shell' is not one of"),
    ("field-of-other-node-kind", "kind: Workflow\nname: w\nnodes: [{id: a, run: x, prompt: p}]\n",
     "nodes[0].prompt: unknown field 'prompt'"),
    ("bad-provider", "kind: Model\nname: m\nprovider: llama\n", "provider: 'llama' is not one of"),
    ("replay-without-script", "kind: Model\nname: m\nprovider: replay\n", "a replay model needs script"),
    ("replay-missing-file", "kind: Model\nname: m\nprovider: replay\nscript: nope.yaml\n", "file not found"),
    ("http-base-url", "kind: Model\nname: m\nprovider: openai\nmodel: x\nbaseUrl: http://api.example/v1\n",
     "baseUrl: must be an https:// URL"),
    ("github-without-token", ("kind: Workspace\nname: x\nrepo: https://github.com/a/b.git\n"
     "forge: {type: github, repo: a/b}\n"), "tokenEnv: a github forge needs a token"),
    ("bad-with", "kind: Workflow\nname: w\nnodes: [{id: a, uses: 'builtin:merge', with: {method: yolo}}]\n",
     "with.method: is not one of"),
    ("wrong-type", "kind: Workflow\nname: w\nnodes: [{id: a, run: x, retries: many}]\n",
     "retries: must be a whole number"),
    ("not-a-mapping", "- just\n- a list\n", "afe.yaml#1 (document): must be a mapping"),
    ("yaml-syntax", "kind: Workspace\nname: [unclosed\n", "fix the YAML syntax"),
]


@pytest.mark.parametrize("case,text,expected", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_refusal(tmp_path, case, text, expected):
    message = errors_of(tmp_path, text)
    assert expected in message, message


def test_every_error_is_collected_not_just_the_first(tmp_path):
    text = WORKSPACE + "colour: red\nsandbox: {limits: {memory: lots}}\n---\nkind: Gadget\nname: g\n"
    message = errors_of(tmp_path, text)
    assert "colour" in message and "memory" in message and "afe.yaml#2 kind" in message
    assert message.startswith("3 problem(s)")


def test_positive_control_local_paths_and_https_are_accepted(tmp_path):
    text = ("kind: Workspace\nname: a\nrepo: file:///srv/git/a.git\n---\n"
            "kind: Workspace\nname: b\nrepo: https://github.com/acme/b.git\ntokenEnv: B_TOKEN\n"
            "forge: {type: github, repo: acme/b}\n---\n"
            "kind: Model\nname: local\nprovider: openai\nmodel: x\nbaseUrl: http://127.0.0.1:8000/v1\n"
            "---\nkind: Workspace\nname: c\nrepo: /abs/c.git\nsandbox: {egress: [pypi.org, .pythonhosted.org]}\n")
    cfg = load_config(write(tmp_path, text))
    assert cfg.workspaces["b"].forge.repo == "acme/b"
    assert cfg.workspaces["c"].sandbox.egress == ("pypi.org", ".pythonhosted.org")
    assert cfg.credential_env_names() == ["B_TOKEN"]


# R27/R28: a secret-looking value in ANY field is refused; the error names the
# field and the kind of secret, never the value.
SECRETS = [
    ("ghp", "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"),
    ("github_pat", "github_pat_" + "11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz"),
    ("gho", "gho_" + "Zz9Yy8Xx7Ww6Vv5Uu4Tt3Ss2Rr1Qq0"),
    ("sk", "sk-" + "proj-4f9aQz7LmN2xR8tV1bK6cW3yH5jD0"),
    ("slack", "xoxb-" + "1234567890-abcdefghijkl"),
    ("aws", "AKIA" + "IOSFODNN7EXAMPLE"),
    ("jwt", "eyJhbGciOiJIUzI1NiJ9." + "eyJzdWIiOiIxMjM0NTY3ODkwIn0." + "dBjftJeZ4CVPmB92K27uhbUJU1p1r_wW1gFWFOEjXk"),
    ("entropy", "Qm9vZ3p5X2F1dGhfdG9rZW5fOGY3YTJjOWQxZTRiNmE"),
    ("url-password", "https://bob:hunter2hunter2@git.example/a.git"),
]
FIELDS = [
    ("tokenEnv", lambda v: WORKSPACE + f"tokenEnv: '{v}'\n"),
    ("author.email", lambda v: WORKSPACE + f"author: {{email: '{v}'}}\n"),
    ("baseUrl", lambda v: f"kind: Model\nname: m\nprovider: openai\nmodel: x\nbaseUrl: '{v}'\n"),
    ("command[1]", lambda v: f"kind: Agent\nname: a\ntype: acp\ncommand: [tool, '{v}']\n"),
    ("nodes[0].prompt", lambda v: f"kind: Workflow\nname: w\nnodes: [{{id: a, run: x, prompt: 'key {v}'}}]\n"),
    ("nodes[0].run", lambda v: f"kind: Workflow\nname: w\nnodes: [{{id: a, run: 'curl -H {v}'}}]\n"),
    ("colour", lambda v: WORKSPACE + f"colour: '{v}'\n"),     # even in an unknown field
]


@pytest.mark.parametrize("field,make", FIELDS, ids=[f[0] for f in FIELDS])
@pytest.mark.parametrize("kind,value", SECRETS, ids=[s[0] for s in SECRETS])
def test_r28_secret_value_in_any_field_is_refused_without_echo(tmp_path, field, make, kind, value):
    message = errors_of(tmp_path, make(value))
    assert f"afe.yaml#1 {field}: looks like a secret" in message, message
    assert value not in message
    # Not even a recognisable piece of it.
    for piece in (value[:12], value[-12:]):
        assert piece not in message


def test_r28_secret_in_a_field_name_is_not_echoed(tmp_path):
    value = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
    message = errors_of(tmp_path, WORKSPACE + f"{value}: 1\n")
    assert "looks like a secret" in message and value not in message


def test_r28_positive_control_ordinary_values_pass_the_secret_scan(tmp_path):
    """The scan is not vacuous-by-refusing-everything: long prompts, commands, SHAs pass."""
    sha = "3abbebf0c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6"
    text = (WORKSPACE + "---\nkind: Workflow\nname: w\nworkspace: shop\nnodes:\n"
            f"  - {{id: a, run: 'git checkout {sha} && python3 -m unittest -v tests.test_calculator_module'}}\n")
    cfg = load_config(write(tmp_path, text))
    assert sha in cfg.workflows["w"].nodes[0].run


def test_missing_env_names_variable_and_manifest_never_value(tmp_path):
    text = WORKSPACE + "tokenEnv: SHOP_TOKEN\n---\n" + AGENT
    cfg = load_config(write(tmp_path, text))
    assert missing_env(cfg, {"CODER_KEY": "set"}) == [("SHOP_TOKEN", "afe.yaml#1 Workspace shop tokenEnv")]
    assert missing_env(cfg, {"CODER_KEY": "x", "SHOP_TOKEN": ""})[0][0] == "SHOP_TOKEN"
    assert missing_env(cfg, {"CODER_KEY": "x", "SHOP_TOKEN": "y"}) == []


def test_replay_script_in_config_folder_is_not_read_as_a_manifest(tmp_path):
    write(tmp_path, MODEL.replace("scripts/script.yaml", "script.yaml"))
    (tmp_path / "script.yaml").write_text("responses:\n  - content: done\n")
    cfg = load_config(tmp_path)
    assert list(cfg.models) == ["m"]


def test_empty_folder_says_what_to_add(tmp_path):
    with pytest.raises(ConfigError, match="no manifests found"):
        load_config(tmp_path)


def test_readme_configuration_example_validates(tmp_path):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "afe.yaml").write_text(example)
    cfg = load_config(tmp_path)
    assert cfg.credential_env_names() == ["ANTHROPIC_API_KEY", "OPENAI_API_KEY", "SHOP_GITHUB_TOKEN"]
    assert cfg.agent_env_names() == []        # the key stays in the credential broker (R32, R43)


def test_afe_check_lists_every_problem_and_exits_1(tmp_path, capsys):
    from services.cli.main import main

    secret = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
    write(tmp_path, WORKSPACE + f"tokenEnv: {secret}\nsandbox: {{limits: {{memory: lots}}}}\n")
    assert main(["check", "--config", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "afe.yaml#1 tokenEnv: looks like a secret (GitHub token)" in err
    assert "afe.yaml#1 sandbox.limits.memory: 'lots' is not a size" in err
    assert secret not in err


def test_afe_check_summarises_a_valid_config(tmp_path, capsys):
    from services.cli.main import main
    from tests.support.fakes.git_http import make_bare_repo

    write(tmp_path, GOOD)
    (tmp_path / "repos").mkdir()
    make_bare_repo(tmp_path / "repos", "shop.git", {"README.md": "x\n"})   # afe check opens it, finds main
    assert main(["check", "--config", str(tmp_path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "OK — 1 workspace(s), 1 model(s), 1 agent(s), 1 workflow(s)" in out
    assert "workflow wf: plan -> code -> test -> pr -> merge" in out
    assert "CODER_KEY is not set" in out
