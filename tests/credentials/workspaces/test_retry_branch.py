"""A retried ticket continues its own branch (real git, the real broker core):
ReleaseWorkspace keeps the workspace's last state in the mirror and
PrepareWorkspace continues from it or from the pushed branch; UpdateBranch
merges the base into the pushed branch on the host, or names the conflicts
and pushes nothing."""

from __future__ import annotations

import pytest

from services.common.secrecy.redact import Redactor
from services.credentials.compose import build_core
from tests.credentials.conftest import git_plain, local_workspace, make_config

pytestmark = pytest.mark.timeout(60)


def _rev(origin, ref: str) -> str:
    return git_plain("--git-dir", str(origin), "rev-parse", ref).stdout.decode().strip()


def _upstream(origin, path: str, text: str) -> str:
    """Someone else changes `path` on main of the bare `origin`."""
    wt = origin.parent / "upstream-wt"
    if not wt.exists():
        git_plain("clone", "-q", str(origin), str(wt))
    git_plain("-C", str(wt), "pull", "-q", "origin", "main")
    (wt / path).write_text(text)
    git_plain("-C", str(wt), "commit", "-qam", "upstream")
    git_plain("-C", str(wt), "push", "-q", "origin", "HEAD:main")
    return _rev(origin, "main")


async def test_a_released_workspace_comes_back_for_a_retry_with_its_uncommitted_work(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    core = build_core(config, layout, {}, Redactor())
    try:
        first = await core.prepare_workspace("rt-1", "local")
        work = layout.workspace("rt-1")
        (work / "src" / "app.py").write_text("print('fixed')\n")
        await core.release_workspace("rt-1", "local")
        assert not work.exists() and not layout.gitdir("rt-1").exists()

        again = await core.prepare_workspace("rt-1", "local")
        assert again.base_sha == first.base_sha
        assert (work / "src" / "app.py").read_text() == "print('fixed')\n"     # the agent's work is back
        diff, _ = await core.diff("rt-1", "local", 0)
        assert "+print('fixed')" in diff
        c = await core.commit("rt-1", "local", "fix")
        parent = git_plain("--git-dir", str(layout.gitdir("rt-1")), "rev-parse", f"{c.sha}^").stdout.decode().strip()
        assert c.changed and parent == first.base_sha                          # no "kept" commit in the history
        branch, pushed = await core.push("rt-1", "local")
        (work / "NOTES.md").write_text("more\n")
        await core.release_workspace("rt-1", "local")

        await core.prepare_workspace("rt-1", "local")
        assert (work / "NOTES.md").read_text() == "more\n"
        assert _rev(layout.gitdir("rt-1"), f"refs/heads/{branch}") == pushed   # continues the pushed branch
        c2 = await core.commit("rt-1", "local", "notes")
        assert c2.changed and c2.files_changed == 1

        # Positive control: a ticket never released before starts at the base.
        await core.prepare_workspace("rt-2", "local")
        assert (layout.workspace("rt-2") / "src" / "app.py").read_text() == "print('hi')\n"
    finally:
        await core.close()


async def test_update_branch_merges_the_base_or_names_the_conflicts_and_pushes_nothing(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    core = build_core(config, layout, {}, Redactor())
    try:
        await core.prepare_workspace("ub-1", "local")
        (layout.workspace("ub-1") / "src" / "app.py").write_text("print('ticket')\n")
        await core.commit("ub-1", "local", "change app")
        branch, head = await core.push("ub-1", "local")
        assert await core.update_branch("ub-1", "local") == (head, False, [])   # already on the base

        base = _upstream(local_origin, "README.md", "# moved on\n")
        new, changed, conflicts = await core.update_branch("ub-1", "local")
        assert changed and not conflicts and new != head
        assert _rev(local_origin, f"refs/heads/{branch}") == new
        parents = git_plain("--git-dir", str(local_origin), "rev-list", "--parents", "-n1", new).stdout.decode().split()
        assert parents[1:] == [head, base]

        _upstream(local_origin, "src/app.py", "print('upstream')\n")
        same, changed, conflicts = await core.update_branch("ub-1", "local")
        assert (same, changed, conflicts) == (new, False, ["src/app.py"])
        assert _rev(local_origin, f"refs/heads/{branch}") == new                # nothing pushed
    finally:
        await core.close()
