"""A node's checkpoint and the restore of a takeover's new attempt (real git,
the real broker core; docs/SCALE.md "A takeover is a new attempt"):
CheckpointWorkspace keeps the workspace's state after a node without moving
the branch; RestoreWorkspace puts the workspace back to the state after a
given node (or the branch head), so the re-run of the interrupted node does
not start from its files; the commit that follows holds the re-run's work
once."""

from __future__ import annotations

import os

import pytest

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.secrecy.redact import Redactor
from services.credentials.compose import build_core
from tests.credentials.conftest import git_plain, local_workspace, make_config

pytestmark = pytest.mark.timeout(60)


def _append(path, text: str) -> None:
    path.write_text((path.read_text() if path.exists() else "") + text)


def _show(gitdir, rev: str, path: str) -> str:
    return git_plain("--git-dir", str(gitdir), "show", f"{rev}:{path}").stdout.decode()


async def test_restore_puts_the_workspace_back_to_the_last_completed_node_and_the_commit_has_the_rerun_once(
        local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    core = build_core(config, layout, {}, Redactor())
    try:
        prepared = await core.prepare_workspace("ck-1", "local")
        work, gitdir = layout.workspace("ck-1"), layout.gitdir("ck-1")
        branch = f"refs/heads/{prepared.branch}"
        # node `setup` completes: its state is kept, the branch does not move
        (work / "setup.txt").write_text("installed\n")
        kept = await core.checkpoint_workspace("ck-1", "local", "setup")
        assert git_plain("--git-dir", str(gitdir), "rev-parse", branch).stdout.decode().strip() == prepared.base_sha
        assert _show(gitdir, kept, "setup.txt") == "installed\n"
        # node `edit` is interrupted half-way: a line appended, a stray file, a removed one
        _append(work / "NOTES.md", "streamed by attempt 1\n")
        (work / "partial.txt").write_text("half\n")
        os.unlink(work / "setup.txt")

        assert await core.restore_workspace("ck-1", "local", "setup") == kept
        assert (work / "setup.txt").read_text() == "installed\n"              # the completed node's work
        assert not (work / "partial.txt").exists()                            # not the interrupted attempt's
        assert not (work / "NOTES.md").exists()                               # (the repository has none)
        assert (work / ".git").is_dir()                                       # the sandbox's scratch repository

        _append(work / "NOTES.md", "streamed by attempt 2\n")  # attempt 2 of `edit`
        c = await core.commit("ck-1", "local", "edit")
        notes = _show(gitdir, c.sha, "NOTES.md")
        assert notes.count("streamed by") == 1 and "attempt 2" in notes
        assert sorted(git_plain("--git-dir", str(gitdir), "diff", "--name-only", prepared.base_sha, c.sha)
                      .stdout.decode().split()) == ["NOTES.md", "setup.txt"]

        # "": the branch head (no node changed the workspace since the commit)
        (work / "late.txt").write_text("x\n")
        assert await core.restore_workspace("ck-1", "local", "") == c.sha
        assert not (work / "late.txt").exists() and (work / "setup.txt").exists()

        # a node whose checkpoint was never kept: refused, the workspace left as it is
        (work / "late.txt").write_text("x\n")
        with pytest.raises(FailedPrecondition, match="no checkpoint was kept after node 'other'"):
            await core.restore_workspace("ck-1", "local", "other")
        assert (work / "late.txt").exists()
        with pytest.raises(InvalidArgument):
            await core.checkpoint_workspace("ck-1", "local", "../../heads/main")
    finally:
        await core.close()


async def test_positive_control_without_a_restore_the_rerun_commits_the_interrupted_attempts_files_too(
        local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    core = build_core(config, layout, {}, Redactor())
    try:
        await core.prepare_workspace("ck-2", "local")
        work, gitdir = layout.workspace("ck-2"), layout.gitdir("ck-2")
        _append(work / "NOTES.md", "streamed by attempt 1\n")
        await core.prepare_workspace("ck-2", "local")                         # what a resume does today
        _append(work / "NOTES.md", "streamed by attempt 2\n")
        c = await core.commit("ck-2", "local", "edit")
        assert _show(gitdir, c.sha, "NOTES.md").count("streamed by") == 2
    finally:
        await core.close()
