"""`afe init [PATH] [--provider openai|anthropic]`: write a starter `afe.d/`
for the git repository at PATH (default: here):

- `workspace.yaml`: the repository itself as a local forge (a working
  repository is fine), its current branch as the base branch, and the
  project sandbox image;
- `model.yaml`: a Model stub naming OPENAI_API_KEY or ANTHROPIC_API_KEY;
- `workflow.yaml`: fix (a model with the file and run tools) -> test (whose
  failure goes back to fix, `on_failure`) -> pull request -> merge (which
  waits for your approval);
- `images/NAME/Dockerfile`: FROM afe/sandbox with the project's test
  runner, built by `afe images build` as `afe/project-NAME:latest`
  (services/common/host/images.py::build_project_images).

Nothing is overwritten: an existing `afe.d/` is refused.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PROVIDERS = {
    "openai": ("OPENAI_API_KEY", "gpt-4o-mini", "https://api.openai.com/v1"),
    "anthropic": ("ANTHROPIC_API_KEY", "claude-sonnet-4-5", "https://api.anthropic.com"),
}


@dataclass(frozen=True)
class Runner:
    """How a project's tests run, and what the sandbox image needs for it."""
    language: str
    command: str
    packages: tuple[str, ...]


def detect_runner(repo: Path) -> Runner:
    if (repo / "package.json").exists():
        return Runner("node", "npm test", ("nodejs", "npm"))
    if (repo / "go.mod").exists():
        return Runner("go", "go test ./...", ("golang-go",))
    if (repo / "Cargo.toml").exists():
        return Runner("rust", "cargo test --offline", ("cargo",))
    if any((repo / f).exists() for f in ("pyproject.toml", "setup.py", "setup.cfg", "pytest.ini", "tox.ini")) \
            or (repo / "tests").is_dir():
        return Runner("python", "python3 -m pytest -q", ("python3-pytest",))
    return Runner("python", "python3 -m unittest -v", ())


def project_image(name: str) -> str:
    return f"afe/project-{name}:latest"


def _name(repo: Path) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", repo.name.lower()).strip("-")
    return (name or "project")[:40]


def _branch(repo: Path) -> str:
    r = subprocess.run(["git", "-C", str(repo), "symbolic-ref", "--quiet", "--short", "HEAD"],
                       capture_output=True, text=True, check=False,
                       env={"PATH": "/usr/bin:/bin", "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent"})
    return r.stdout.strip() or "main"


def dockerfile(runner: Runner) -> str:
    install = ""
    if runner.packages:
        install = ("USER root\n"
                   "RUN apt-get update \\\n"
                   f"    && apt-get install -y --no-install-recommends {' '.join(runner.packages)} \\\n"
                   "    && rm -rf /var/lib/apt/lists/*\n"
                   "USER 10001:10001\n")
    return (f"# The sandbox image of this project: afe's sandbox plus what `{runner.command}` needs.\n"
            "# Build (or rebuild after editing) with `afe images build`; it is tagged with the name in\n"
            "# workspace.yaml (sandbox.image). Tickets run as uid 10001 with no network unless the\n"
            "# Workspace lists sandbox.egress, so install dependencies here, not in a run: step.\n"
            "FROM afe/sandbox:latest\n" + install)


def files(repo: Path, provider: str) -> dict[str, str]:
    name, branch, runner = _name(repo), _branch(repo), detect_runner(repo)
    key_env, model_id, base_url = PROVIDERS[provider]
    return {
        "workspace.yaml": (
            f"# The repository tickets change: this one, as a local forge (pull requests are kept by afe,\n"
            f"# a merge moves {branch}). For GitHub: repo: https://github.com/OWNER/NAME.git, tokenEnv,\n"
            "# forge: {type: github, repo: OWNER/NAME}. Fields: docs/GUIDE.md, 'Your repository'.\n"
            "kind: Workspace\n"
            f"name: {name}\n"
            "repo: ..                     # relative to this folder\n"
            f"baseBranch: {branch}\n"
            "forge: {type: local}\n"
            "sandbox:\n"
            f"  image: {project_image(name)}   # built from images/{name}/Dockerfile by `afe images build`\n"
            "  limits: {cpus: 1, memory: 1g, pids: 256}\n"),
        "model.yaml": (
            "# The model the fix node talks to. The key is read from the environment of `afe up`,\n"
            "# never written here. Other providers and self-hosted servers: docs/GUIDE.md.\n"
            "kind: Model\n"
            "name: coder\n"
            f"provider: {provider}\n"
            f"model: {model_id}            # the model id your provider serves\n"
            f"apiKeyEnv: {key_env}\n"
            f"# baseUrl: {base_url}   # or your server, e.g. http://localhost:8000/v1\n"
            "# price: {input: 0.15, output: 0.60}   # USD per million tokens, for cost estimates\n"),
        "workflow.yaml": (
            "# What a ticket does: the model fixes the issue, the tests run in the sandbox, a pull\n"
            "# request is opened and merged after you approve it (afe approve ID).\n"
            "kind: Workflow\n"
            "name: fix\n"
            f"workspace: {name}\n"
            "maxTokens: 200000              # the ticket's token budget\n"
            "nodes:\n"
            "  - id: fix\n"
            "    model: coder\n"
            "    prompt: |\n"
            "      Fix this issue in the repository.\n"
            "      Title: {{ticket.title}}\n"
            "      {{ticket.body}}\n"
            f"      The tests run with `{runner.command}`; run them before you answer.\n"
            "    tools: [read_file, write_file, list_dir, search, run]\n"
            "    max_turns: 30\n"
            "  - id: test\n"
            f"    run: \"{runner.command}\"\n"
            "    needs: [fix]\n"
            "    timeout: 600\n"
            "    on_failure: {retry_from: fix, max: 2}   # failing tests go back to fix, quoted\n"
            "  - id: pr\n"
            "    uses: builtin:open_pr\n"
            "    needs: [test]\n"
            "  - id: merge\n"
            "    uses: builtin:merge\n"
            "    needs: [pr]\n"),
        f"images/{name}/Dockerfile": dockerfile(runner),
    }


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("init", help="write a starter afe.d/ for a git repository",
                       description="Write PATH/afe.d/ (Workspace, Model stub, fix -> test -> PR -> merge "
                       "workflow, project sandbox Dockerfile) for the git repository at PATH.")
    p.add_argument("path", nargs="?", default=".", help="the repository (default: the current folder)")
    p.add_argument("--provider", choices=sorted(PROVIDERS), default="openai",
                   help="the Model stub's provider (default: openai; also any OpenAI-compatible server)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.common.errors import AfeError
    from services.common.host.gitrepo import git_dir

    repo = Path(args.path).expanduser().absolute()
    try:
        git_dir(repo, repo.name)
    except AfeError as exc:
        print(f"afe init: {exc.message.split(': ', 1)[-1]}", file=sys.stderr)
        return 1
    target = repo / "afe.d"
    if target.exists():
        print(f"afe init: {target} already exists; edit it, or move it away and run afe init again",
              file=sys.stderr)
        return 1
    for rel, text in files(repo, args.provider).items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    key_env = PROVIDERS[args.provider][0]
    print(f"wrote {target}/: workspace.yaml, model.yaml, workflow.yaml, images/{_name(repo)}/Dockerfile\n"
          "next:\n"
          f"  1. edit {target / 'model.yaml'} (model id, baseUrl) and export {key_env}\n"
          f"  2. afe images build --config {target}    # the project sandbox image\n"
          f"  3. afe check --config {target}\n"
          f"  4. afe up --config {target}, then afe ticket create --workflow fix --title '...' --watch\n"
          "docs/GUIDE.md explains every field.")
    return 0
