"""A sandbox that removes a directory while a host tool holds it open gets
a clear AfeError back, never a raw OSError (an internal error)."""

from __future__ import annotations

import os

import pytest

from services.common.errors import AfeError, NotFound
from services.sandbox.files.paths import Root
from services.sandbox.files.tools import FileTools


def _mkdir_in_removed_dir(root_path, dfd_source):
    dfd = dfd_source()
    try:
        os.rmdir(root_path / "d")  # what the racing sandbox does
        os.mkdir("m", 0o755, dir_fd=dfd)
    finally:
        os.close(dfd)


def test_oserror_in_a_vanished_directory_becomes_not_found(tmp_path):
    (tmp_path / "d").mkdir()
    # Positive control: the same steps without the Root boundary leak a raw OSError.
    with pytest.raises(FileNotFoundError):
        _mkdir_in_removed_dir(tmp_path, lambda: os.open(tmp_path / "d", os.O_RDONLY | os.O_DIRECTORY))
    (tmp_path / "d").mkdir()
    with pytest.raises(NotFound) as info, Root(os.fspath(tmp_path)) as root:
        _mkdir_in_removed_dir(tmp_path, lambda: root.open_dir(["d"]))
    assert "removed while the call ran" in str(info.value)


def test_tools_still_work_on_a_stable_tree(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    tools = FileTools(lambda ticket: ws)
    tools.mkdir("t1", "a/b", parents=True)
    tools.write("t1", "a/b/f", b"x")
    assert tools.read("t1", "a/b/f")[0] == b"x"
    with pytest.raises(AfeError):
        tools.read("t1", "a/b/missing")
