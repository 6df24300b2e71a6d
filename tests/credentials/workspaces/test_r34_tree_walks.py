"""R34: every host-side walk of a sandbox-made tree is iterative and bounded.

A sandbox can leave a 10,000-deep directory tree in its workspace. Python's
recursive walkers (os.fwalk, shutil.rmtree in 3.11) raise RecursionError on
it -- the positive controls below show that on the very same tree. The commit
snapshot fails with a message naming its limit; removing the workspace always
succeeds, never follows a link and never leaves the tree.

Also here: names with a newline (and other odd bytes) are committed, not
dropped; other git repositories inside the workspace are reported.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from services.common import treewalk
from services.common.errors import FailedPrecondition
from services.common.secrecy.redact import Redactor
from services.credentials.compose import build_core
from services.credentials.workspaces import snapshot
from tests.credentials.conftest import broker_stub, git_plain, local_workspace, make_config

pytestmark = pytest.mark.timeout(120)

DEEP = 10_000


def make_deep(root, depth: int = DEEP, name: bytes = b"d") -> None:
    """A chain of `depth` directories under root (built fd by fd, as a sandbox could),
    with a file every 100 levels and a symlink to /etc at the bottom."""
    fd = os.open(root, treewalk.DIR_FLAGS)
    try:
        for i in range(depth):
            os.mkdir(name, dir_fd=fd)
            if i % 100 == 0:
                os.close(os.open(b"f", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
            sub = os.open(name, treewalk.DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = sub
        os.symlink("/etc", b"link", dir_fd=fd)
    finally:
        os.close(fd)


@pytest.fixture(autouse=True)
def _remove_deep_trees(tmp_path):
    """pytest's own clean-up of old tmp_paths is shutil.rmtree: remove our deep trees first."""
    yield
    for child in list(tmp_path.iterdir()):
        treewalk.remove_tree(child)


@pytest.mark.slow
def test_r34_positive_control_python_recursive_walkers_fail_on_a_deep_tree(tmp_path):
    root = tmp_path / "w"
    root.mkdir()
    make_deep(root)
    with pytest.raises(RecursionError):
        for _ in os.fwalk(root, follow_symlinks=False):
            pass
    if sys.version_info < (3, 12):  # shutil.rmtree became iterative in 3.12
        with pytest.raises(RecursionError):
            shutil.rmtree(root)
        assert root.exists()
    treewalk.remove_tree(root)
    assert not root.exists()


@pytest.mark.slow
def test_r34_walk_fails_naming_the_depth_and_entry_limits(tmp_path):
    root = tmp_path / "w"
    root.mkdir()
    make_deep(root)
    fd = os.open(root, treewalk.DIR_FLAGS)
    try:
        with pytest.raises(treewalk.TreeTooLarge) as exc:
            for _ in treewalk.walk(fd, treewalk.Limits("the commit snapshot")):
                pass
        assert exc.value.limit == "depth"
        assert "deeper than 256 directories (limit of the commit snapshot)" in exc.value.message
        # Positive control: the same walk with a limit above the depth sees every level.
        seen = sum(1 for it in treewalk.walk(fd, treewalk.Limits("t", max_depth=DEEP + 1)) if it.is_dir)
        assert seen == DEEP
        with pytest.raises(treewalk.TreeTooLarge) as exc:
            for _ in treewalk.walk(fd, treewalk.Limits("the commit snapshot", max_depth=DEEP + 1,
                                                       max_entries=500)):
                pass
        assert exc.value.limit == "entries"
        assert "more than 500 files and directories (limit of the commit snapshot)" in exc.value.message
    finally:
        os.close(fd)


def test_r34_remove_tree_stays_inside_and_never_follows_links(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (outside / "sub").mkdir()
    root = tmp_path / "w"
    root.mkdir()
    make_deep(root, 300)
    # links to the outside at the top and at the bottom of the tree
    os.symlink(outside, root / "to-outside")
    bottom = root.joinpath(*["d"] * 300)
    os.symlink(outside, bottom / "to-outside")
    os.symlink(outside / "keep.txt", bottom / "to-file")
    treewalk.remove_tree(root)
    assert not root.exists()
    assert (outside / "keep.txt").read_text() == "keep" and (outside / "sub").is_dir()
    # a link given as the tree itself is removed, its target is not
    link = tmp_path / "link"
    os.symlink(outside, link)
    treewalk.remove_tree(link)
    assert not link.exists() and (outside / "keep.txt").exists()
    treewalk.remove_tree(tmp_path / "missing" / "x")  # nothing to do


@pytest.mark.slow
def test_r34_snapshot_of_a_deep_workspace_fails_naming_the_limit(tmp_path):
    root = tmp_path / "w"
    root.mkdir()
    make_deep(root)
    with pytest.raises(FailedPrecondition) as exc:
        snapshot.scan(root)
    assert "the workspace is deeper than 256 directories (limit of the commit snapshot)" in exc.value.message
    # at the limit it is content
    shallow = tmp_path / "s"
    shallow.mkdir()
    make_deep(shallow, 255)
    found = snapshot.scan(shallow)
    assert len(found.dirs) == 255 and len(found.links) == 1


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_r34_chown_fallback_is_bounded_and_never_follows_links(tmp_path):
    from services.credentials.workspaces.host import _chown_tree
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "w"
    root.mkdir()
    make_deep(root, 20)
    os.symlink(outside, root / "to-outside")
    _chown_tree(root, 12345, 12345)
    assert os.lstat(root.joinpath(*["d"] * 20)).st_uid == 12345
    assert os.lstat(root / "to-outside").st_uid == 12345
    assert os.stat(outside).st_uid == 0
    (root / "deep").mkdir()
    make_deep(root / "deep", DEEP)
    with pytest.raises(FailedPrecondition) as exc:
        _chown_tree(root, 12345, 12345)
    assert "deeper than 256 directories (limit of the workspace hand-over to the sandbox)" in exc.value.message


async def test_r34_release_removes_a_10000_deep_workspace(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    core = build_core(config, layout, {}, Redactor(), spare_checkouts=False)
    try:
        await core.prepare_workspace("deep", "local")
        work = layout.workspace("deep")
        make_deep(work)
        with pytest.raises(FailedPrecondition) as exc:
            await core.commit("deep", "local", "deep")
        assert "deeper than 256 directories (limit of the commit snapshot)" in exc.value.message
        await core.release_workspace("deep", "local")
        assert not work.exists() and not layout.gitdir("deep").exists()
        # prepare again over a leftover deep tree: removed first, then checked out
        work.mkdir()
        make_deep(work)
        await core.prepare_workspace("deep", "local")
        assert (work / "README.md").exists() and not (work / "d").exists()
    finally:
        await core.close()


ODD_NAMES = [b"new\nline.txt", b"tab\there.txt", b"quote\"s'.txt", b"back\\slash.txt", b"latin1-\xe9.txt",
             b"-leading-dash.txt", b"--end-of-options", b"nl-dir\n/inner.txt"]


async def test_r34_names_with_newline_and_odd_bytes_are_committed(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    core = build_core(config, layout, {}, Redactor(), spare_checkouts=False)
    try:
        await core.prepare_workspace("odd", "local")
        work = layout.workspace("odd")
        for name in ODD_NAMES:
            path = work / os.fsdecode(name)
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(b"content of " + name)
        # a .gitignore rule applies to a newline-named file too
        (work / ".gitignore").write_bytes((work / ".gitignore").read_bytes() + b"\n*.ignored\n")
        (work / "x\n.ignored").write_bytes(b"no")
        done = await core.commit("odd", "local", "odd names")
        assert done.changed
        listing = git_plain("--git-dir", str(layout.gitdir("odd")), "ls-tree", "-r", "-z", "--name-only",
                            done.sha).stdout.split(b"\0")
        for name in ODD_NAMES:
            assert name in listing, name
            blob = git_plain("--git-dir", str(layout.gitdir("odd")), "cat-file", "blob",
                             done.sha + ":" + os.fsdecode(name)).stdout
            assert blob == b"content of " + name
        assert b"x\n.ignored" not in listing
        # Positive control: a newline-separated listing (what a non -z reader sees) cannot
        # name the file: git quotes it, so only NUL-separated plumbing round-trips it.
        plain = git_plain("--git-dir", str(layout.gitdir("odd")), "ls-tree", "-r", "--name-only",
                          done.sha).stdout.split(b"\n")
        assert b"new\nline.txt" not in plain
    finally:
        await core.close()


async def test_r34_nested_git_repositories_are_reported_by_the_commit(local_origin, layout):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with broker_stub(config, layout) as (stub, _redactor):
        await stub.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="nest", workspace="local"))
        work = layout.workspace("nest")
        git_plain("init", "-q", str(work / "vendor" / "lib"))
        (work / "vendor" / "lib" / "lib.py").write_text("x = 1\n")
        (work / "gitlink").mkdir()
        (work / "gitlink" / ".git").write_text("gitdir: /elsewhere\n")
        (work / "gitlink" / "a.txt").write_text("a\n")
        git_plain("init", "-q", "--bare", str(work / "store.git"))
        (work / "plain").mkdir()
        (work / "plain" / "HEAD").write_text("not a repository: no objects/ nor refs/\n")
        r = await stub.Commit(pb.CommitRequest(ticket_id="nest", workspace="local", message="nested"))
        assert list(r.nested_repositories) == ["gitlink", "store.git", "vendor/lib"]
        listing = git_plain("--git-dir", str(layout.gitdir("nest")), "ls-tree", "-r", "-z", "--name-only",
                            r.sha).stdout.split(b"\0")
        # Positive control: the bare repository really is in the commit as plain files.
        assert b"store.git/HEAD" in listing and b"store.git/config" in listing
        assert b"vendor/lib/lib.py" in listing and b"vendor/lib/.git/config" not in listing
        # The workspace's own scratch .git is not reported; with nothing nested, nothing is.
        await stub.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="clean", workspace="local"))
        assert (layout.workspace("clean") / ".git" / "HEAD").exists()
        (layout.workspace("clean") / "new.txt").write_text("n\n")
        r = await stub.Commit(pb.CommitRequest(ticket_id="clean", workspace="local", message="clean"))
        assert r.changed and list(r.nested_repositories) == []
