"""`afe init` writes a starter afe.d/ for a repository that `afe check` accepts;
`afe check` verifies each local repository and its base branch, every
template reference and every required input; `afe images build` builds the
project image."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from services.cli.main import main

GIT_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=GIT_ENV, capture_output=True, text=True,
                          check=True).stdout


def project(tmp: Path, branch: str = "trunk", files: dict[str, str] | None = None) -> Path:
    repo = tmp / "My Project"
    repo.mkdir()
    git("init", "-q", "-b", branch, cwd=repo)
    for rel, text in (files or {"calc.py": "def add(a, b):\n    return a - b\n"}).items():
        (repo / rel).write_text(text)
    git("add", "-A", cwd=repo)
    git("commit", "-qm", "initial", cwd=repo)
    return repo


def afe(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_init_writes_a_config_that_check_accepts(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("AFE_DATABASE_URL", raising=False)
    repo = project(tmp_path, files={"pyproject.toml": "[project]\nname='x'\n", "calc.py": "x = 1\n"})
    code, out, err = afe(capsys, "init", str(repo), "--provider", "anthropic")
    assert code == 0, err
    conf = repo / "afe.d"
    assert "afe images build --config" in out and "ANTHROPIC_API_KEY" in out
    ws = (conf / "workspace.yaml").read_text()
    assert "baseBranch: trunk" in ws and "name: my-project" in ws and "afe/project-my-project:latest" in ws
    assert "apiKeyEnv: ANTHROPIC_API_KEY" in (conf / "model.yaml").read_text()
    docker = (conf / "images" / "my-project" / "Dockerfile").read_text()
    assert docker.splitlines()[4] == "FROM afe/sandbox:latest" and "python3-pytest" in docker
    assert 'run: "python3 -m pytest -q"' in (conf / "workflow.yaml").read_text()
    assert "on_failure: {retry_from: fix, max: 2}" in (conf / "workflow.yaml").read_text()

    code, out, err = afe(capsys, "check", "--config", str(conf))
    assert code == 0, err
    assert "workflow fix: fix -> test -> pr -> merge" in out
    assert "ANTHROPIC_API_KEY is not set" in out or "ANTHROPIC_API_KEY" not in out

    # Never overwrites.
    code, _, err = afe(capsys, "init", str(repo))
    assert code == 1 and "already exists" in err


def test_init_refuses_a_folder_that_is_not_a_repository(tmp_path, capsys):
    code, _, err = afe(capsys, "init", str(tmp_path))
    assert code == 1 and "git init" in err and not (tmp_path / "afe.d").exists()


def _config(tmp: Path, repo: str, workflow: str, base: str = "trunk") -> Path:
    conf = tmp / "conf"
    conf.mkdir(exist_ok=True)
    (conf / "afe.yaml").write_text(textwrap.dedent(f"""\
        kind: Workspace
        name: ws
        repo: {repo}
        baseBranch: {base}
        ---
        """) + textwrap.dedent(workflow))
    return conf


WF = """\
kind: Workflow
name: wf
workspace: ws
{inputs}
nodes:
  - {{id: a, run: "echo {{{{ticket.title}}}}"}}
  - {{id: b, run: {run}, needs: [a]}}
"""


@pytest.mark.parametrize(("inputs", "run", "message"), [
    ("", '"echo {{ticket.titel}}"', "nodes[1].run: unknown template reference {{ticket.titel}}"),
    ("", '"echo {{ticket.inputs.issue}}"', "names an input the workflow does not declare; declared: none"),
    ("", '"echo {{nodes.b.output}}"', "add it to `needs`"),
    ("", "\"echo '{{ticket.title}}'\"", "inside single quotes"),
    ("inputs: [issue]", '"echo {{nodes.a.output}} {{ticket.inputs.issue}}"', None),
    ("inputs: [{name: issue, default: '42'}]", '"echo {{ticket.inputs.issue}}"', None),
])
def test_check_refuses_template_references_that_cannot_resolve(tmp_path, capsys, inputs, run, message):
    repo = project(tmp_path)
    conf = _config(tmp_path, str(repo), WF.format(inputs=inputs, run=run))
    code, _, err = afe(capsys, "check", "--config", str(conf))
    if message is None:
        assert code == 0, err
    else:
        assert code == 1 and message in err and "afe.yaml#2" in err


@pytest.mark.parametrize(("repo", "base", "message"), [
    ("missing", "trunk", "does not exist; create the repository there (git init)"),
    ("plain", "trunk", "is not a git repository; run `git init` there"),
    ("My Project", "main", "has no branch 'main'; branches: trunk. Set baseBranch"),
])
def test_check_verifies_the_local_repository_and_base_branch(tmp_path, capsys, repo, base, message):
    project(tmp_path)
    (tmp_path / "plain").mkdir()
    conf = _config(tmp_path, f"../{repo}", WF.format(inputs="", run='"true"'), base=base)
    code, _, err = afe(capsys, "check", "--config", str(conf))
    assert code == 1 and message in err and "Workspace ws" in err
    # The control: the right branch of the right repository passes.
    conf = _config(tmp_path, "../My Project", WF.format(inputs="", run='"true"'), base="trunk")
    assert afe(capsys, "check", "--config", str(conf))[0] == 0


def test_check_notes_a_remote_repository_is_checked_only_online(tmp_path, capsys):
    conf = _config(tmp_path, "https://git.invalid/acme/widgets.git", WF.format(inputs="", run='"true"'))
    code, out, _ = afe(capsys, "check", "--config", str(conf))
    assert code == 0 and "afe check --online" in out


def test_trigger_must_map_every_required_input(tmp_path, capsys):
    repo = project(tmp_path)
    conf = _config(tmp_path, str(repo), WF.format(inputs="inputs: [issue]", run='"true"'))
    text = (conf / "afe.yaml").read_text().replace("repo: ", "forge: {type: github, repo: acme/w}\nrepo: ", 1)
    (conf / "afe.yaml").write_text(text + "---\nkind: Trigger\nname: t\nworkspace: ws\nworkflow: wf\n")
    code, _, err = afe(capsys, "check", "--config", str(conf))
    assert code == 1 and "needs input 'issue'; map it here" in err


@pytest.mark.docker
def test_images_build_builds_the_project_image(tmp_path, capsys):
    repo = project(tmp_path)    # no test runner found: unittest, nothing to install
    assert afe(capsys, "init", str(repo))[0] == 0
    image = "afe/project-my-project:latest"
    try:
        code, out, err = afe(capsys, "images", "build", "--config", str(repo / "afe.d"))
        assert code == 0, err
        assert f"building {image}" in out
        r = subprocess.run(["docker", "run", "--rm", image, "id", "-u"], capture_output=True, text=True,
                           check=True)
        assert r.stdout.strip() == "10001"
    finally:
        subprocess.run(["docker", "image", "rm", "-f", image], capture_output=True, check=False)


VERIFY_WF = """\
kind: Workflow
name: wf
workspace: ws
verify:
  run: ["python3 -m pytest -q"]
  base_paths: [tests/]
nodes:
  - {id: test, run: "python3 -m pytest -q"}
  - {id: pr, uses: builtin:open_pr, needs: [test]}
  - {id: merge, uses: builtin:merge, needs: [pr]}
"""


def test_check_refuses_verify_base_paths_the_base_branch_lacks(tmp_path, capsys):
    """The GUIDE's `verify:` (base_paths: [tests/]) pasted into a project whose tests sit
    at the top: `afe check` names it, instead of every ticket failing at its approval
    with "verification could not run". Control: once the base branch has tests/, it passes."""
    repo = project(tmp_path, files={"calc.py": "def add(a, b):\n    return a - b\n",
                                    "test_calc.py": "from calc import add\n"})
    conf = _config(tmp_path, "../My Project", VERIFY_WF)
    code, _, err = afe(capsys, "check", "--config", str(conf))
    assert code == 1, err
    assert "afe.yaml#2 Workflow wf verify.base_paths: 'tests/' is not on trunk of" in err, err
    assert "name a folder or file the base branch has" in err

    (repo / "tests").mkdir()
    git("mv", "test_calc.py", "tests/test_calc.py", cwd=repo)
    git("commit", "-qm", "tests/", cwd=repo)
    code, _, err = afe(capsys, "check", "--config", str(conf))
    assert code == 0, err
