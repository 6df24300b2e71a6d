"""R34 in the sandbox broker: search, recursive remove and the ownership
fix-up on re-create walk a sandbox-made tree iteratively and within limits.
The positive control: Python's recursive os.fwalk (what chown_tree used)
raises RecursionError on the same 10,000-deep tree."""

from __future__ import annotations

import os

import pytest

from services.common import treewalk
from services.common.errors import FailedPrecondition
from services.sandbox.files.tools import FileTools
from services.sandbox.sandboxes import chown_tree
from tests.credentials.workspaces.test_r34_tree_walks import make_deep

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def deep_ws(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "top.txt").write_text("needle at the top\n")
    (root / "deep").mkdir()
    make_deep(root / "deep")
    yield root
    for child in list(tmp_path.iterdir()):
        treewalk.remove_tree(child)  # pytest's own clean-up would recurse


@pytest.mark.slow
def test_r34_positive_control_fwalk_recurses_on_the_tree(deep_ws):
    with pytest.raises(RecursionError):
        for _ in os.fwalk(deep_ws, follow_symlinks=False):
            pass


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_r34_chown_tree_on_recreate_fails_naming_the_limit(deep_ws, tmp_path):
    with pytest.raises(FailedPrecondition) as exc:
        chown_tree(str(deep_ws), 4242, 4242)
    assert "deeper than 256 directories (limit of the sandbox's workspace ownership check)" in exc.value.message
    shallow = tmp_path / "shallow"
    shallow.mkdir()
    make_deep(shallow, 50)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, shallow / "to-outside")
    assert chown_tree(str(shallow), 4242, 4242) == 50 + 1 + 1 + 1 + 1  # root, dirs, file, 2 links
    assert os.stat(outside).st_uid == 0


@pytest.mark.slow
def test_r34_search_fails_naming_the_limit_and_remove_takes_any_depth(deep_ws):
    tools = FileTools(lambda _t: deep_ws)
    with pytest.raises(FailedPrecondition) as exc:
        tools.search("t", "needle")
    assert "deeper than 128 directories (limit of search)" in exc.value.message
    matches, _ = tools.search("t", "needle", "top.txt")
    assert [m.path for m in matches] == ["top.txt"]
    tools.remove("t", "deep", recursive=True)
    assert sorted(os.listdir(deep_ws)) == ["top.txt"]
    matches, truncated = tools.search("t", "needle")
    assert [m.path for m in matches] == ["top.txt"] and not truncated
