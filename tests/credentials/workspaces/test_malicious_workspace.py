"""A hostile sandbox plants git traps in the workspace it writes (R1, R2, R13).

Host commit, diff and push must fire none of them, leak no token and store
no host file. Each trap has a positive control: plain git, run the ordinary
way in the same workspace, does fire it -- so the test cannot pass because
the trap was broken.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from tests.credentials.conftest import (
    TOKEN_ENV,
    all_objects,
    broker_stub,
    git_plain,
    make_config,
    remote_workspace,
    tree_listing,
)

pytestmark = pytest.mark.timeout(120)

CANARY = "host-canary-5f1c0a9e-do-not-commit"
SAFE = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "safe.directory", "GIT_CONFIG_VALUE_0": "*"}


@dataclass
class Env:
    work: Path          # the workspace the sandbox writes
    fired: Path         # where trap scripts leave markers
    evil: Path          # a host folder outside the workspace (another repo, etc.)
    script: Path        # the trap script (inside the workspace, as a sandbox would write it)
    server_url: str
    ca_file: Path

    def git(self, *args: str, check: bool = False):
        return git_plain(*args, cwd=self.work, env={**SAFE, "GIT_SSL_CAINFO": str(self.ca_file),
                                                    "GIT_TERMINAL_PROMPT": "0"}, check=check)

    def config(self, key: str, value: str, file: Path | None = None) -> None:
        git_plain("config", "--file", str(file or self.work / ".git" / "config"), key, value)


def _script(path: Path, fired: Path) -> None:
    path.write_text(f"#!/bin/sh\nname=$(basename \"$0\")\necho fired > '{fired}'/\"$name\"\n"
                    f"env > '{fired}'/\"$name\".env\nexit 0\n")
    path.chmod(0o755)


def _scratch_repo(e: Env) -> None:
    """The sandbox's own scratch repository in the workspace (allowed)."""
    git_plain("init", "-q", str(e.work))


def _hooks(folder: Path, fired: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for hook in ("pre-commit", "post-commit", "reference-transaction", "pre-push", "post-checkout"):
        _script(folder / hook, fired)


def plant_hooks(e: Env) -> None:
    _scratch_repo(e)
    _hooks(e.work / ".git" / "hooks", e.fired)


def control_commit_and_push(e: Env) -> None:
    bare = e.evil / "control-remote.git"
    git_plain("init", "-q", "--bare", str(bare))
    e.git("add", "-A")
    e.git("commit", "-qm", "control")
    e.git("push", "-q", str(bare), "HEAD:refs/heads/control")


def plant_fsmonitor(e: Env) -> None:
    _scratch_repo(e)
    e.config("core.fsmonitor", str(e.script))


def control_status(e: Env) -> None:
    e.git("add", "-A")
    e.git("status")


def plant_hooks_path(e: Env) -> None:
    _scratch_repo(e)
    _hooks(e.work / ".evil-hooks", e.fired)
    e.config("core.hooksPath", str(e.work / ".evil-hooks"))


def plant_ssh_command(e: Env) -> None:
    _scratch_repo(e)
    e.config("core.sshCommand", str(e.script))


def control_ssh_push(e: Env) -> None:
    e.git("add", "-A")
    e.git("commit", "-qm", "control")
    e.git("push", "ssh://127.0.0.1:9/x.git", "HEAD:refs/heads/x")


def plant_diff_external(e: Env) -> None:
    _scratch_repo(e)
    e.config("diff.external", str(e.script))


def control_diff(e: Env) -> None:
    e.git("add", "-A")
    (e.work / "README.md").write_text("# changed again by the control\n")
    e.git("diff")


def plant_include(e: Env) -> None:
    _scratch_repo(e)
    inc = e.work / ".git" / "evil.cfg"
    _hooks(e.work / ".git" / "inc-hooks", e.fired)
    e.config("core.hooksPath", str(e.work / ".git" / "inc-hooks"), file=inc)
    e.config("include.path", str(inc))


def control_commit(e: Env) -> None:
    e.git("add", "-A")
    e.git("commit", "-qm", "control")


def plant_credential_helper(e: Env) -> None:
    _scratch_repo(e)
    e.config("credential.helper", str(e.script))


def control_fetch_with_auth(e: Env) -> None:
    e.git("ls-remote", e.server_url)


def plant_filter(e: Env) -> None:
    _scratch_repo(e)
    (e.work / ".gitattributes").write_text("* filter=evil\n")
    e.config("filter.evil.clean", str(e.script))
    e.config("filter.evil.smudge", str(e.script))


def control_add(e: Env) -> None:
    e.git("add", "-A")


def plant_diff_driver(e: Env) -> None:
    _scratch_repo(e)
    (e.work / ".gitattributes").write_text("*.md diff=evil\n")
    e.config("diff.evil.command", str(e.script))
    e.config("diff.evil.textconv", str(e.script))


def _evil_repo(e: Env) -> Path:
    repo = e.evil / "elsewhere.git"
    git_plain("init", "-q", "--bare", str(repo))
    git_plain("config", "--file", str(repo / "config"), "core.bare", "false")
    _hooks(repo / "hooks", e.fired)
    return repo


def _drop_scratch(e: Env) -> None:
    if (e.work / ".git").exists():
        shutil.rmtree(e.work / ".git")


def plant_gitfile(e: Env) -> None:
    _drop_scratch(e)
    (e.work / ".git").write_text(f"gitdir: {_evil_repo(e)}\n")


def plant_git_symlink(e: Env) -> None:
    _drop_scratch(e)
    os.symlink(_evil_repo(e), e.work / ".git")


def plant_canary_links(e: Env) -> None:
    (e.evil / "canary.txt").write_text(CANARY + "\n")
    (e.evil / "canary-dir").mkdir()
    (e.evil / "canary-dir" / "inside.txt").write_text(CANARY + " (dir)\n")
    os.symlink(e.evil / "canary.txt", e.work / "leak.txt")
    os.symlink(e.evil / "canary-dir", e.work / "leakdir")
    os.mkfifo(e.work / "a-fifo")


def control_hash_paths(e: Env) -> None:
    """A naive snapshot that hands paths to git (or open()) reads through the link."""
    naive = e.evil / "naive.git"
    git_plain("init", "-q", "--bare", str(naive))
    git_plain("--git-dir", str(naive), "hash-object", "-w", "--stdin-paths",
              stdin=f"{e.work / 'leak.txt'}\n".encode())
    if CANARY.encode() in all_objects(naive):
        (e.fired / "canary").write_text("read through the link\n")


@dataclass(frozen=True)
class Trap:
    name: str
    plant: Callable[[Env], None]
    control: Callable[[Env], None]
    marker: str         # what the control must leave in `fired`


TRAPS = [
    Trap("hooks", plant_hooks, control_commit_and_push, "pre-push"),
    Trap("core.fsmonitor", plant_fsmonitor, control_status, ".trap.sh"),
    Trap("core.hooksPath", plant_hooks_path, control_commit, "pre-commit"),
    Trap("core.sshCommand", plant_ssh_command, control_ssh_push, ".trap.sh"),
    Trap("diff.external", plant_diff_external, control_diff, ".trap.sh"),
    Trap("include.path", plant_include, control_commit, "post-commit"),
    Trap("credential.helper", plant_credential_helper, control_fetch_with_auth, ".trap.sh"),
    Trap("gitattributes-filter", plant_filter, control_add, ".trap.sh"),
    Trap("gitattributes-diff-driver", plant_diff_driver, control_diff, ".trap.sh"),
    Trap("gitfile-elsewhere", plant_gitfile, control_commit, "pre-commit"),
    Trap("git-symlink-elsewhere", plant_git_symlink, control_commit, "pre-commit"),
    Trap("symlink-to-host-canary", plant_canary_links, control_hash_paths, "canary"),
]


@pytest.mark.parametrize("trap", TRAPS, ids=[t.name for t in TRAPS])
async def test_r1_r2_host_git_fires_no_workspace_trap(trap, git_server, tls, git_token, layout, short_tmp):
    ticket = "trap-" + trap.name.replace(".", "-").lower()[:50]
    config = make_config(layout.data_dir.parent, remote_workspace(git_server))
    fired = short_tmp / "fired"
    evil = short_tmp / "evil"
    fired.mkdir(mode=0o777)
    evil.mkdir()
    async with broker_stub(config, layout, secrets_={TOKEN_ENV: git_token}, ca_file=tls.cert_file) as (s, _):
        await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=ticket, workspace="remote"))
        work = layout.workspace(ticket)
        e = Env(work, fired, evil, work / ".trap.sh", git_server.url("origin.git"), tls.cert_file)
        _script(e.script, fired)
        (work / "README.md").write_text("# changed by the sandbox\n")
        trap.plant(e)

        commit = await s.Commit(pb.CommitRequest(ticket_id=ticket, workspace="remote", message="work"))
        diff = await s.Diff(pb.DiffRequest(ticket_id=ticket, workspace="remote"))
        pushed = await s.Push(pb.PushRequest(ticket_id=ticket, workspace="remote"))

    # Nothing fired, no token anywhere the sandbox can see, no host file in a blob.
    assert sorted(os.listdir(fired)) == []
    assert commit.changed and pushed.sha == commit.sha
    for store in (layout.gitdir(ticket), git_server.root / "origin.git"):
        assert CANARY.encode() not in all_objects(store)
    tree = tree_listing(layout.gitdir(ticket), commit.sha)
    assert not any(p == ".git" or p.startswith(".git/") for p in tree)
    assert "changed by the sandbox" in diff.diff
    for dirpath, _dirs, names in os.walk(work):
        for n in names:
            p = Path(dirpath) / n
            if p.is_file() and not p.is_symlink() and stat.S_ISREG(p.lstat().st_mode):
                assert git_token.encode() not in p.read_bytes()
    if trap.name == "symlink-to-host-canary":
        assert tree["leak.txt"][0] == "120000" and tree["leakdir"][0] == "120000"
        assert "a-fifo" not in tree
        target = git_plain("--git-dir", str(layout.gitdir(ticket)), "cat-file", "blob", tree["leak.txt"][1])
        assert target.stdout.decode() == str(evil / "canary.txt")

    # Positive control: plain git in the same workspace springs the trap.
    trap.control(e)
    assert trap.marker in os.listdir(fired), f"control for {trap.name} did not fire: not a real trap"


FLIPPER = """
import os, shutil, sys
work, canary, canary_dir = sys.argv[1:4]
f, d = os.path.join(work, "racy.txt"), os.path.join(work, "racydir")
def clear(p):
    try:
        if os.path.islink(p) or os.path.isfile(p):
            os.unlink(p)
        elif os.path.isdir(p):
            shutil.rmtree(p)
    except OSError:
        pass
while True:
    for make_link in (True, False):
        clear(f); clear(d)
        try:
            if make_link:
                os.symlink(canary, f); os.symlink(canary_dir, d)
            else:
                with open(f, "w") as fh:
                    fh.write("plain\\n")
                os.mkdir(d)
                with open(os.path.join(d, "f.txt"), "w") as fh:
                    fh.write("plain\\n")
        except OSError:
            pass
"""


async def test_r2_symlink_swapped_during_commit_never_reaches_a_blob(local_origin, layout, short_tmp):
    """A sandbox process flips a file and a folder to links at a host canary while we commit."""
    import subprocess
    import sys

    from tests.credentials.conftest import local_workspace

    canary = short_tmp / "canary.txt"
    canary.write_text(CANARY + "\n")
    canary_dir = short_tmp / "canary-dir"
    canary_dir.mkdir()
    (canary_dir / "f.txt").write_text(CANARY + "\n")
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with broker_stub(config, layout) as (s, _):
        await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="race", workspace="local"))
        work = layout.workspace("race")
        flipper = subprocess.Popen(  # noqa: ASYNC220 -- the "sandbox" process, killed below
            [sys.executable, "-c", FLIPPER, str(work), str(canary), str(canary_dir)])
        try:
            for i in range(15):
                (work / "README.md").write_text(f"round {i}\n")
                await s.Commit(pb.CommitRequest(ticket_id="race", workspace="local", message=f"round {i}"))
                await s.Diff(pb.DiffRequest(ticket_id="race", workspace="local"))
            # Positive control: a path-following reader under the same flipping reads the canary.
            naive_hit = False
            for _ in range(200000):
                try:
                    if CANARY in (work / "racy.txt").read_text() or CANARY in (work / "racydir" / "f.txt").read_text():
                        naive_hit = True
                        break
                except OSError:
                    continue
            assert flipper.poll() is None, "the flipper died"
        finally:
            flipper.kill()
            flipper.wait()
    assert CANARY.encode() not in all_objects(layout.gitdir("race"))
    assert naive_hit, "the flipper never exposed the canary: the race is not a real race"
