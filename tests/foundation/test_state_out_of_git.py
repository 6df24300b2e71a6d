"""afe's state never lands in a commit of the repository it runs in (issue 35).

`afe up` in a user's repository keeps the signing private key, the UI token,
the automation key and the store in `.afe/`. Whoever makes that folder
(`Layout.ensure`, which every process and `afe up` call, and `afe up`'s demo)
writes `.afe/.gitignore` ignoring everything in it, so a real `git add -A`
stages nothing of it. Positive control: without that file the same
`git add -A` stages the private key and the tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.common.layout import GITIGNORE, Layout

ROOT = Path(__file__).resolve().parents[2]
GIT_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": "/dev/null", "LC_ALL": "C"}
SECRETS = ("data/credentials/signing/ed25519.pem", "data/ui-token", "run/automation.key", "data/afe.db")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          env=GIT_ENV).stdout


def user_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "myproject"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    return repo


def staged_after_add_all(repo: Path) -> list[str]:
    git(repo, "add", "-A")
    return git(repo, "diff", "--cached", "--name-only").split()


def write_state(state: Path) -> None:
    """What a running afe keeps: the files issue 35 found untracked in the repository."""
    for rel in SECRETS:
        path = state / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("secret\n")


def test_git_add_all_stages_nothing_of_afe_state(tmp_path):
    repo = user_repo(tmp_path)
    Layout(repo / ".afe" / "data", repo / ".afe" / "run").ensure()
    write_state(repo / ".afe")
    assert (repo / ".afe" / ".gitignore").read_bytes() == GITIGNORE
    assert staged_after_add_all(repo) == ["calc.py"]
    assert git(repo, "status", "--porcelain", "--ignored", ".afe").strip() == "!! .afe/"

    # Positive control: the same state without the ignore file is staged, private key first.
    (repo / ".afe" / ".gitignore").unlink()
    staged = staged_after_add_all(repo)
    for rel in SECRETS:
        assert f".afe/{rel}" in staged, staged


def test_an_older_afe_folder_gets_its_ignore_file_at_the_next_start(tmp_path):
    repo = user_repo(tmp_path)
    write_state(repo / ".afe")          # made by an afe before the fix: no .gitignore
    assert any(p.startswith(".afe/") for p in staged_after_add_all(repo))
    git(repo, "reset", "-q")
    Layout(repo / ".afe" / "data", repo / ".afe" / "run").ensure()
    assert staged_after_add_all(repo) == ["calc.py"]


def test_a_users_own_ignore_file_is_left_alone(tmp_path):
    state = tmp_path / ".afe"
    state.mkdir()
    (state / ".gitignore").write_text("data/\nrun/\n")
    Layout(state / "data", state / "run").ensure()
    assert (state / ".gitignore").read_text() == "data/\nrun/\n"


def test_a_folder_afe_makes_elsewhere_is_ignored_one_it_did_not_make_is_not_touched(tmp_path):
    repo = user_repo(tmp_path)
    Layout(repo / "state" / "data", repo / "state" / "run").ensure()   # --data state/data: afe made state/
    write_state(repo / "state")
    assert staged_after_add_all(repo) == ["calc.py"]

    existing = tmp_path / "var-lib-afe"      # a folder made by the deployment (deploy/systemd)
    (existing / "data").mkdir(parents=True)
    Layout(existing / "data", existing / "run").ensure()
    assert not (existing / ".gitignore").exists() and not (existing / "data" / ".gitignore").exists()
    assert (existing / "run" / ".gitignore").read_bytes() == GITIGNORE     # afe made run/


def test_afe_up_with_the_bundled_demo_leaves_nothing_to_commit(tmp_path):
    """`afe up` in a repository without afe.d copies the demo into .afe/demo (a git
    repository of its own) before anything else; a bad flag then stops it at once."""
    repo = user_repo(tmp_path)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    r = subprocess.run([sys.executable, "-m", "services.cli.main", "up", "--max-failed-logins", "0"],
                       cwd=repo, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                       check=False, timeout=60)
    assert r.returncode != 0 and "--max-failed-logins 0" in r.stderr, r.stderr
    assert (repo / ".afe" / "demo" / "afe.yaml").is_file() and (repo / ".afe" / "data").is_dir()
    assert staged_after_add_all(repo) == ["calc.py"]
