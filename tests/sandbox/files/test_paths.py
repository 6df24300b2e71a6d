"""R17-R19 as a table: (layout, path, tool, expected) for every file tool,
with positive controls showing each attack works against a naive
implementation (os.path.join + open)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from services.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from services.sandbox.files.tools import DEFAULT_READ_CAP, MAX_WRITE, FileTools

pytestmark = pytest.mark.timeout(60)

SECRET = b"OUTSIDE-SECRET-CONTENT"
INSIDE = b"inside-content-marker"
TOOLS = ("read", "write", "list", "stat", "remove", "mkdir", "search")


@pytest.fixture
def ws(tmp_path):
    """root/ is the workspace; outside/ holds a secret the tools must never reach."""
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET)
    (root / "real.txt").write_bytes(INSIDE)
    (root / "realdir").mkdir()
    (root / "realdir" / "file.txt").write_bytes(INSIDE)
    os.symlink("real.txt", root / "link.txt")                     # symlink inside root
    os.symlink("realdir", root / "linkdir")                       # symlinked dir inside root
    os.symlink(str(outside), root / "esc")                        # symlink escaping
    os.symlink(str(outside / "created.txt"), root / "dangling")   # dangling, pointing out
    os.mkfifo(root / "fifo")
    with open(root / "huge.bin", "wb") as f:
        f.truncate(DEFAULT_READ_CAP * 20)
    deep = root
    for i in range(100):
        deep = deep / f"d{i}"
    deep.mkdir(parents=True)
    (deep / "leaf.txt").write_bytes(b"leaf inside-content-marker")
    tools = FileTools(lambda _t: root)
    return tools, root, outside


def call(tools: FileTools, tool: str, path: str):
    if tool == "read":
        return tools.read("t", path)
    if tool == "write":
        return tools.write("t", path, b"written")
    if tool == "list":
        return tools.list_dir("t", path)
    if tool == "stat":
        return tools.stat("t", path)
    if tool == "remove":
        return tools.remove("t", path)
    if tool == "mkdir":
        return tools.mkdir("t", path)
    if tool == "search":
        return tools.search("t", "inside", path)
    raise AssertionError(tool)


DEEP = "/".join(f"d{i}" for i in range(100))
TOO_DEEP = "/".join(f"x{i}" for i in range(200))
ALL_INVALID = dict.fromkeys(TOOLS, InvalidArgument)
ALL_SYMLINK = dict.fromkeys(TOOLS, PermissionDenied)

# case -> (path, {tool: expected}); "ok" means the call succeeds.
TABLE = {
    "dotdot": ("../outside/secret.txt", ALL_INVALID),
    "dotdot_inside": ("realdir/../real.txt", ALL_INVALID),
    "absolute": (None, ALL_INVALID),   # filled with the absolute outside path
    "nul": ("real.txt\x00.png", ALL_INVALID),
    "empty": ("", {**ALL_INVALID, "list": "ok", "stat": "ok", "search": "ok"}),
    "empty_component": ("realdir//file.txt", ALL_INVALID),
    "trailing_slash": ("realdir/", ALL_INVALID),
    "dot": ("./real.txt", ALL_INVALID),
    "symlink_inside_root": ("link.txt", ALL_SYMLINK),
    "symlinked_dir_inside_root": ("linkdir", ALL_SYMLINK),
    "symlink_escaping": ("esc", ALL_SYMLINK),
    "through_escaping_symlink": ("esc/secret.txt", ALL_SYMLINK),
    "intermediate_symlinked_dir": ("linkdir/file.txt", ALL_SYMLINK),
    "dangling_symlink_create": ("dangling", ALL_SYMLINK),
    "fifo": ("fifo", {"read": FailedPrecondition, "write": FailedPrecondition, "list": FailedPrecondition,
                      "stat": "ok", "remove": "ok", "mkdir": AlreadyExists, "search": FailedPrecondition}),
    "deep_nesting": (DEEP + "/leaf.txt", {"read": "ok", "write": "ok", "list": FailedPrecondition,
                                          "stat": "ok", "remove": "ok", "mkdir": AlreadyExists, "search": "ok"}),
    "too_deep": (TOO_DEEP, ALL_INVALID),
    "missing": ("nope/none.txt", {**dict.fromkeys(TOOLS, NotFound)}),
    "regular_file": ("real.txt", {"read": "ok", "write": "ok", "list": FailedPrecondition, "stat": "ok",
                                  "remove": "ok", "mkdir": AlreadyExists, "search": "ok"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("case", sorted(TABLE))
def test_r17_r18_r19_path_table(ws, case, tool):
    tools, _root, outside = ws
    path, expected = TABLE[case]
    if path is None:
        path = str(outside / "secret.txt")
    want = expected[tool]
    if want == "ok":
        call(tools, tool, path)
    else:
        with pytest.raises(want) as ei:
            call(tools, tool, path)
        msg = str(ei.value)
        assert SECRET.decode() not in msg and INSIDE.decode() not in msg     # errors never echo content
    # whatever happened, nothing outside the root changed
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (outside / "secret.txt").read_bytes() == SECRET


def naive_read(root: Path, path: str) -> bytes:
    return open(os.path.join(root, path), "rb").read()


@pytest.mark.parametrize("path", ["../outside/secret.txt", "esc/secret.txt", "ABS"])
def test_r17_r19_positive_control_naive_join_escapes(ws, path):
    """Without the defence the same paths DO reach the outside secret."""
    _, root, outside = ws
    if path == "ABS":
        path = str(outside / "secret.txt")
    assert naive_read(root, path) == SECRET


def test_r19_positive_control_naive_write_through_dangling_link_creates_outside(ws):
    _, root, outside = ws
    with open(os.path.join(root, "dangling"), "wb") as f:
        f.write(b"x")
    assert (outside / "created.txt").exists()


def test_fifo_positive_control_naive_open_blocks(ws):
    """A plain open() of a FIFO blocks forever; the tools return at once."""
    _, root, _ = ws
    done = threading.Event()

    def opener():
        with open(root / "fifo", "rb"):
            done.set()
    threading.Thread(target=opener, daemon=True).start()
    assert not done.wait(0.5)
    # unblock the thread
    fd = os.open(root / "fifo", os.O_WRONLY | os.O_NONBLOCK)
    os.close(fd)


def test_huge_file_read_is_capped(ws):
    tools, _, _ = ws
    data, size, truncated = tools.read("t", "huge.bin")
    assert len(data) == DEFAULT_READ_CAP and truncated and size == DEFAULT_READ_CAP * 20
    data, _, truncated = tools.read("t", "huge.bin", max_bytes=10)
    assert len(data) == 10 and truncated


def test_write_size_is_capped(ws):
    tools, root, _ = ws
    with pytest.raises(ResourceExhausted):
        tools.write("t", "big.bin", b"x" * (MAX_WRITE + 1))
    assert not (root / "big.bin").exists()


def test_write_replaces_atomically_and_leaves_no_temp(ws):
    tools, root, _ = ws
    tools.write("t", "new/dir/file.txt", b"hello", create_parents=True, mode=0o600)
    assert (root / "new/dir/file.txt").read_bytes() == b"hello"
    assert oct((root / "new/dir/file.txt").stat().st_mode & 0o777) == "0o600"
    tools.write("t", "new/dir/file.txt", b"again")
    assert (root / "new/dir/file.txt").read_bytes() == b"again"
    assert [p.name for p in (root / "new/dir").iterdir()] == ["file.txt"]


def test_list_shows_symlinks_without_following(ws):
    tools, _, _ = ws
    entries, truncated = tools.list_dir("t", "")
    kinds = {e.name: e.type for e in entries}
    assert kinds["esc"] == "symlink" and kinds["realdir"] == "directory" and kinds["fifo"] == "other"
    assert not truncated


def test_search_does_not_follow_symlinks(ws):
    tools, _, _ = ws
    (ws[2] / "secret.txt").write_bytes(b"inside " + SECRET)
    matches, _ = tools.search("t", "inside", "")
    paths = {m.path for m in matches}
    assert "real.txt" in paths and "realdir/file.txt" in paths and DEEP + "/leaf.txt" in paths
    assert not any(p.startswith(("esc", "linkdir", "link.txt")) for p in paths)
    assert all(SECRET.decode() not in m.text for m in matches)


def test_remove_recursive_removes_links_not_targets(ws):
    tools, root, outside = ws
    (root / "tree").mkdir()
    os.symlink(str(outside), root / "tree" / "esc")
    (root / "tree" / "f").write_bytes(b"x")
    with pytest.raises(FailedPrecondition):
        tools.remove("t", "tree")
    tools.remove("t", "tree", recursive=True)
    assert not (root / "tree").exists()
    assert (outside / "secret.txt").read_bytes() == SECRET


def test_mkdir_parents_and_exists(ws):
    tools, root, _ = ws
    tools.mkdir("t", "a/b/c", parents=True)
    assert (root / "a/b/c").is_dir()
    tools.mkdir("t", "a/b/c", parents=True)
    with pytest.raises(AlreadyExists):
        tools.mkdir("t", "a/b/c")
    with pytest.raises(NotFound):
        tools.mkdir("t", "x/y")


@pytest.mark.parametrize("pattern", [r"(a+)+$", r"(a*)*b", r"(a|aa)*c", r"(x+x+)+y", r"(a)\1", r"(?:a{2,}){2,}"])
def test_search_refuses_catastrophic_regex(ws, pattern):
    tools, _, _ = ws
    with pytest.raises(InvalidArgument):
        tools.search("t", pattern, "", regex=True)


@pytest.mark.parametrize("pattern", [r"def \w+\(", r"[a-z]+_[0-9]*", r"^import (os|sys)$", r"inside-.*marker"])
def test_search_accepts_ordinary_regex(ws, pattern):
    tools, _, _ = ws
    tools.search("t", pattern, "", regex=True)
