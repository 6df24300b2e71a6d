"""Workspace preparation details: spare checkouts, ownership, the git dir
outside the workspace, .gitignore honoured by the snapshot."""

from __future__ import annotations

import os

import pytest

from services.common.layout import SANDBOX_UID
from services.common.secrecy.redact import Redactor
from services.credentials.compose import build_core, private_dir
from tests.credentials.conftest import git_plain, local_workspace, make_config

pytestmark = pytest.mark.timeout(60)


def _advance(origin, text: str) -> str:
    """Add a commit on main of the bare `origin` (as someone else pushing)."""
    tree = git_plain("--git-dir", str(origin), "mktree", stdin=b"").stdout.decode().strip()
    blob = git_plain("--git-dir", str(origin), "hash-object", "-w", "--stdin", stdin=text.encode()).stdout.decode().strip()
    tree = git_plain("--git-dir", str(origin), "mktree", stdin=f"100644 blob {blob}\tREADME.md\n".encode()
                     ).stdout.decode().strip()
    parent = git_plain("--git-dir", str(origin), "rev-parse", "main").stdout.decode().strip()
    sha = git_plain("--git-dir", str(origin), "commit-tree", "-p", parent, "-m", "upstream", tree).stdout.decode().strip()
    git_plain("--git-dir", str(origin), "update-ref", "refs/heads/main", sha)
    return sha


async def test_spare_checkout_is_used_once_and_follows_the_base(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    core = build_core(config, layout, {}, Redactor())
    spares = private_dir(layout) / "spares"
    try:
        first = await core.prepare_workspace("sp-1", "local")
        await core.git.idle()
        ready = [p.name for p in spares.iterdir()]
        assert ready == [p for p in ready if p.endswith(first.base_sha)] and len(ready) == 1
        second = await core.prepare_workspace("sp-2", "local")
        assert second.base_sha == first.base_sha
        work = layout.workspace("sp-2")
        assert (work / "src" / "app.py").read_text() == "print('hi')\n"
        # The sandbox's scratch repository: the base commit, nothing of the host's.
        head = git_plain("--git-dir", str(work / ".git"), "rev-parse", "HEAD").stdout.decode().strip()
        assert head == first.base_sha
        assert "url" not in (work / ".git" / "config").read_text()
        if os.geteuid() == 0:
            assert {os.lstat(p).st_uid for p in [work, *work.rglob("*")]} == {SANDBOX_UID}
        await core.git.idle()

        new_base = _advance(local_origin, "# upstream moved\n")
        third = await core.prepare_workspace("sp-3", "local")
        assert third.base_sha == new_base
        assert (layout.workspace("sp-3") / "README.md").read_text() == "# upstream moved\n"
        assert not (layout.workspace("sp-3") / "src").exists()
        await core.git.idle()
        assert [p.name.endswith(new_base) for p in spares.iterdir()] == [True]
        # Each ticket's git dir is outside every workspace.
        for t in ("sp-1", "sp-2", "sp-3"):
            assert layout.workspaces_dir not in layout.gitdir(t).parents
    finally:
        await core.close()


async def test_snapshot_honours_gitignore_and_skips_special_files(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    core = build_core(config, layout, {}, Redactor(), spare_checkouts=False)
    try:
        await core.prepare_workspace("gi", "local")
        work = layout.workspace("gi")
        (work / "build").mkdir()
        (work / "build" / "out.bin").write_bytes(b"\0" * 10)
        (work / "src" / "cache.pyc").write_bytes(b"junk")
        (work / "src" / "new.py").write_text("x = 1\n")
        (work / "src" / "run.sh").write_text("#!/bin/sh\n")
        os.chmod(work / "src" / "run.sh", 0o755)
        os.mkfifo(work / "pipe")
        (work / "sub").mkdir()
        (work / "sub" / ".git").mkdir()
        (work / "sub" / ".git" / "config").write_text("[core]\n")
        for alias in ("GIT~1", ".GIT."):  # what NTFS/HFS would treat as .git on a reviewer's machine
            (work / alias / "hooks").mkdir(parents=True)
            (work / alias / "hooks" / "post-checkout").write_text("#!/bin/sh\n")
        done = await core.commit("gi", "local", "work")
        files = git_plain("--git-dir", str(layout.gitdir("gi")), "ls-tree", "-r", done.sha).stdout.decode()
        assert "src/new.py" in files and "build/" not in files and "cache.pyc" not in files
        assert "pipe" not in files and ".git" not in files.replace(".gitignore", "")
        assert "GIT~1" not in files and ".GIT" not in files and "post-checkout" not in files
        assert "100755 blob" in next(line for line in files.splitlines() if "run.sh" in line)
        assert done.files_changed == 2
        again = await core.commit("gi", "local", "nothing new")
        assert not again.changed and again.sha == done.sha
        diff, truncated = await core.diff("gi", "local", 40)
        assert truncated and len(diff.encode()) <= 40
    finally:
        await core.close()


async def test_the_ticket_git_dir_is_made_in_few_git_calls_and_a_base_branch_is_one_name(local_origin, layout):
    """The refs of a new ticket's git dir (resolved with one `cat-file`, written
    with `init --initial-branch` and one `update-ref --stdin`): HEAD on the
    ticket's branch, both at the base. A baseBranch holding a space is one name
    that names nothing (never read as two), and the error says so."""
    from services.common.errors import NotFound
    from services.credentials.workspaces.host import branch_for

    config = make_config(layout.data_dir.parent, local_workspace(local_origin),
                         local_workspace(local_origin, name="spaced", base_branch="main HEAD"))
    core = build_core(config, layout, {}, Redactor())
    try:
        r = await core.prepare_workspace("gd-1", "local")
        gitdir = layout.gitdir("gd-1")
        show = git_plain("--git-dir", str(gitdir), "for-each-ref", "--format=%(refname) %(objectname)")
        assert sorted(show.stdout.decode().split("\n")[:-1]) == sorted(
            [f"refs/afe/base {r.base_sha}", f"refs/heads/{branch_for('gd-1')} {r.base_sha}"])
        head = git_plain("--git-dir", str(gitdir), "symbolic-ref", "HEAD").stdout.decode().strip()
        assert head == f"refs/heads/{branch_for('gd-1')}"
        # control: `main` alone resolves in the same mirror, so the refusal below is the space's
        with pytest.raises(NotFound, match="branch 'main HEAD' does not exist"):
            await core.prepare_workspace("gd-2", "spaced")
    finally:
        await core.close()
