"""`afe check [--config DIR] [--online]`: validate the manifests (fields,
references, templates, inputs, the names an Agent's env: may take into the
sandbox) and each Workspace's repository and base branch (repocheck.py), and
say what to fix; warn about each env: name that does enter a sandbox. With
`--online`, list each remote MCP server's tools and check the grants against
them (mcpcheck.py).
`afe check --schema`: print the JSON Schema of the manifests, for editors."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

from services.common.config import egress_rules
from services.common.config.manifests import load_config, missing_env
from services.common.config.model import Config
from services.common.errors import ConfigError
from services.common.schema.sandboxenv import warnings as env_warnings

from .mcpcheck import check_mcp_servers
from .repocheck import check_repositories


def default_config_dir() -> Path | None:
    """`./afe.d` when it exists; None means "the bundled demo"."""
    here = Path("afe.d")
    return here if here.is_dir() else None


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("check", help="validate the manifests in a config folder",
                       description="Validate every *.yaml manifest in the config folder and list every "
                       "problem with its file, document number and field.")
    p.add_argument("--config", default=None,
                   help="manifest folder (default: ./afe.d, else the bundled demo)")
    p.add_argument("--data", default=".afe/data", metavar="DIR",
                   help="data folder, for a relative sqlite AFE_DATABASE_URL (default: .afe/data)")
    p.add_argument("--online", action="store_true",
                   help="also contact each https:// repository (git ls-remote with its tokenEnv) and check "
                   "its base branch, and list each remote MCP server's tools (with its tokenEnv) and check "
                   "the grants against them; local repositories are always checked")
    p.add_argument("--schema", action="store_true",
                   help="print the JSON Schema (draft 2020-12) of every manifest kind, for editors, and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os
    import tempfile

    if getattr(args, "schema", False):
        import json

        from services.common.schema import manifest_json_schema

        print(json.dumps(manifest_json_schema(), indent=2))
        return 0
    directory = Path(args.config) if args.config is not None else default_config_dir()
    try:
        if directory is None:
            with tempfile.TemporaryDirectory(prefix="afe-check-") as tmp:
                config = load_config(_demo_dir(Path(tmp)))
                problems, repo_notes = check_repositories(config, online=False, environ=os.environ)
        else:
            config = load_config(directory)
            problems, repo_notes = check_repositories(config, online=getattr(args, "online", False),
                                                      environ=os.environ)
            mcp_problems, mcp_lines = check_mcp_servers(config, online=getattr(args, "online", False),
                                                        environ=os.environ)
            problems += mcp_problems
            repo_notes += mcp_lines
    except ConfigError as exc:
        print(f"afe check: {exc}", file=sys.stderr)
        print("(file.yaml#N is the N-th document of file.yaml.) Fix the fields above and run "
              "`afe check` again.", file=sys.stderr)
        return 1
    if problems:
        for line in repo_notes:   # what was reached (an MCP server's tools: what a grant may name)
            if not line.lstrip().startswith("note:"):
                print(line)
        print(f"afe check: {len(problems)} problem(s) with the repositories or MCP servers of "
              f"{config.directory}:\n" + "\n".join(f"  {p}" for p in problems), file=sys.stderr)
        return 1
    mcp = f", {len(config.mcp_servers)} MCP server(s)" if config.mcp_servers else ""
    print(f"{config.directory}: OK — {len(config.workspaces)} workspace(s), {len(config.models)} model(s), "
          f"{len(config.agents)} agent(s){mcp}, {len(config.workflows)} workflow(s)")
    for name, wf in sorted(config.workflows.items()):
        print(f"  workflow {name}: {' -> '.join(n.id for n in wf.nodes)}")
    for ws in sorted(config.workspaces.values(), key=lambda w: w.name):
        for line in egress_rules.describe(ws.sandbox.egress_rules):   # what each rule and preset allows (R44)
            print(f"  egress rule of workspace {ws.name}: {line}")
    unset = missing_env(config, os.environ)
    for var, where in unset:
        print(f"  note: {var} is not set in this shell ({where}); `afe up` will refuse to start without it")
    for line in env_warnings(config):   # allowed, but the value is readable in the sandbox (R9, R43)
        print(f"  warning: {line}")
    for line in repo_notes:
        print(line)
    for line in _preset_image_notes(config):
        print(line)
    return _check_database(args, os.environ)


def _check_database(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """With AFE_DATABASE_URL set: can the store be reached, and is its schema
    one this afe can use? (Nothing is created or migrated: the scheduler's
    check, run as a child by services/launcher/storecheck.py.)"""
    from services.common.config.database_url import ENV
    from services.common.errors import AfeError
    from services.common.layout import Layout
    from services.common.secrecy.redact import Redactor
    from services.launcher.storecheck import check_store

    if not environ.get(ENV):
        return 0
    data = Path(getattr(args, "data", None) or ".afe/data").absolute()
    redactor = Redactor([environ[ENV]])
    try:
        line = check_store(Layout(data, data.parent / "run"), environ)
    except AfeError as exc:
        print(f"afe check: {redactor.redact(str(exc))}", file=sys.stderr)
        return 1
    print(f"  store ({ENV}): {line}")
    return 0


def _preset_image_notes(config: Config) -> list[str]:
    """A note per agent whose preset image is missing or built from other inputs."""
    from services.common.config.presets import PRESETS
    from services.common.errors import AfeError
    from services.common.host.images import agent_image_state

    notes = []
    for agent in sorted(config.agents.values(), key=lambda a: a.name):
        preset = PRESETS.get(agent.preset or "")
        if preset is None or agent.image != preset.image:
            continue
        try:
            state = agent_image_state(preset)
        except (AfeError, OSError):
            return ["  note: Docker is not reachable; cannot check the agent preset images"]
        if state != "ready":
            notes.append(f"  note: agent {agent.name}: image {preset.image} is {state}; build it with "
                         f"`afe images build --agent {preset.name}`")
    return notes


def _demo_dir(base: Path) -> Path:
    from services.common import demo

    return demo.materialize(base / "demo")
