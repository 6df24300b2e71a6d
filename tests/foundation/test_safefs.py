"""services/common/safefs as one table, in the style of Go's os.Root tests:
(layout case, path, operation, expected) for every operation against every
case, run on `safefs.Root` (what both brokers use), and positive controls
showing the naive os.open/os.walk/os.chown version of each operation escapes
the root on the same layout.

The layout: root/ is the tree a sandbox made, outside/ holds a secret and a
directory that no operation may read, change, chown or remove.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from services.common import safefs
from services.common.errors import AfeError, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from services.common.safefs import Limits, RelPath, TreeTooLarge

pytestmark = pytest.mark.timeout(120)

SECRET = b"OUTSIDE-SECRET-CONTENT"
SECRET_NAME = "outside-secret.txt"
INSIDE = b"inside-content-marker"
OWNER = 4242                     # what chown hands the tree to (as root)
LIMITS = Limits("the safefs table", max_depth=256)
DEEP = 300                       # deeper than LIMITS.max_depth
ROOT_ONLY = os.geteuid() == 0
OPS = ("open", "read", "write", "list", "walk", "chown", "remove")


def make_chain(top: Path, depth: int) -> None:
    """`depth` nested directories `d` under top, built fd by fd (as a sandbox
    could: no path is ever longer than one name), a file at the bottom."""
    fd = os.open(top, safefs.DIR_FLAGS)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            sub = os.open("d", safefs.DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = sub
        os.close(os.open("leaf.txt", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


@pytest.fixture
def tree(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / SECRET_NAME).write_bytes(SECRET)
    (outside / "sub").mkdir()
    (outside / "sub" / "kept.txt").write_bytes(SECRET)
    (root / "real.txt").write_bytes(INSIDE)
    (root / "realdir").mkdir()
    (root / "realdir" / "file.txt").write_bytes(INSIDE)
    os.symlink("real.txt", root / "link_in")                        # to inside, a file
    os.symlink("realdir", root / "linkdir_in")                      # to inside, a directory
    os.symlink(outside, root / "esc")                               # to outside, a directory
    os.symlink(outside / SECRET_NAME, root / "esc_file")            # to outside, a file
    os.symlink(outside / "created.txt", root / "dangling")          # dangling, pointing out
    os.symlink("loop_b", root / "loop_a")                           # a loop
    os.symlink("loop_a", root / "loop_b")
    os.mkfifo(root / "fifo")
    if ROOT_ONLY:
        os.mknod(root / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    (root / "swapped").mkdir()
    (root / "swapped" / "inner.txt").write_bytes(INSIDE)
    (root / "deep").mkdir()
    make_chain(root / "deep", DEEP)
    yield root, outside
    for child in list(tmp_path.iterdir()):
        safefs.remove_tree(child)    # pytest's own clean-up recurses


def swap_for_link(root: Path, outside: Path) -> None:
    """The sandbox replaces the directory `swapped` by a link to the outside."""
    os.rename(root / "swapped", root / "swapped.old")
    os.symlink(outside, root / "swapped")


def run(root: safefs.Root, op: str, path: str):
    """One operation through safefs; returns what it read (to check for leaks)."""
    rel = RelPath.parse(path, allow_root=op in ("open", "list", "walk", "chown"))
    if op == "open":
        fd = root.open_dir(rel.parts, shown=rel.shown)
        try:
            return safefs.list_names(fd)
        finally:
            os.close(fd)
    if op == "read":
        return root.read(rel, 1 << 20)[0]
    if op == "write":
        return root.write(rel, b"written")
    if op == "list":
        return [name for name, _st in root.list(rel, 1000)[0]]
    if op == "walk":
        return [item.rel for item in root.walk(rel, LIMITS)]
    if op == "chown":
        uid = OWNER if ROOT_ONLY else os.geteuid()
        return root.chown(rel, uid, uid, LIMITS)
    if op == "remove":
        return root.remove(rel, recursive=True)
    raise AssertionError(op)


OK = "ok"
ALL_INVALID = dict.fromkeys(OPS, InvalidArgument)
ALL_LINK = dict.fromkeys(OPS, PermissionDenied)
NOT_A_DIR = {"open": FailedPrecondition, "list": FailedPrecondition, "walk": FailedPrecondition,
             "chown": FailedPrecondition}
SPECIAL = {**NOT_A_DIR, "read": FailedPrecondition, "write": FailedPrecondition, "remove": OK}

# case -> (path, {operation: expected}); OK means the operation succeeds.
TABLE: dict[str, tuple[str, dict[str, object]]] = {
    "regular_file": ("real.txt", {**NOT_A_DIR, "read": OK, "write": OK, "remove": OK}),
    "directory": ("realdir", {**dict.fromkeys(OPS, OK), "read": FailedPrecondition,
                              "write": FailedPrecondition}),
    "file_in_directory": ("realdir/file.txt", {**NOT_A_DIR, "read": OK, "write": OK, "remove": OK}),
    # the whole tree holds the deep chain: a walk of it stops at the limit
    "root_itself": ("", {"open": OK, "list": OK, "walk": TreeTooLarge, "chown": TreeTooLarge,
                         "read": InvalidArgument, "write": InvalidArgument, "remove": InvalidArgument}),
    "missing": ("nope/none.txt", dict.fromkeys(OPS, NotFound)),
    "link_to_inside_file": ("link_in", ALL_LINK),
    "link_to_inside_dir": ("linkdir_in", ALL_LINK),
    "through_link_to_inside_dir": ("linkdir_in/file.txt", ALL_LINK),
    "link_to_outside_dir": ("esc", ALL_LINK),
    "through_link_to_outside": (f"esc/{SECRET_NAME}", ALL_LINK),
    "through_link_to_outside_deeper": ("esc/sub/kept.txt", ALL_LINK),
    "link_to_outside_file": ("esc_file", ALL_LINK),
    "dangling_link_out": ("dangling", ALL_LINK),
    "link_loop": ("loop_a", ALL_LINK),
    "through_link_loop": ("loop_a/x", ALL_LINK),
    "dir_swapped_for_link": ("swapped", ALL_LINK),
    "through_dir_swapped_for_link": (f"swapped/{SECRET_NAME}", ALL_LINK),
    "dotdot": (f"../outside/{SECRET_NAME}", ALL_INVALID),
    "dotdot_inside": ("realdir/../real.txt", ALL_INVALID),
    "absolute": ("<outside>", ALL_INVALID),
    "absolute_inside": ("<root>/real.txt", ALL_INVALID),
    "dot": ("./real.txt", ALL_INVALID),
    "empty_component": ("realdir//file.txt", ALL_INVALID),
    "nul_byte": ("real.txt\x00.png", ALL_INVALID),
    "fifo": ("fifo", SPECIAL),
    "device": ("null", SPECIAL),
    "deep_tree": ("deep", {"open": OK, "read": FailedPrecondition, "write": FailedPrecondition, "list": OK,
                           "walk": TreeTooLarge, "chown": TreeTooLarge, "remove": OK}),
    "path_too_deep": ("/".join(["d"] * 200), ALL_INVALID),
}


def outside_state(outside: Path) -> list[tuple[str, int, int, bytes]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(outside):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath, name)
            st = os.lstat(p)
            out.append((str(p.relative_to(outside)), st.st_uid, st.st_gid,
                        p.read_bytes() if p.is_file() else b""))
    return sorted(out)


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", sorted(TABLE))
def test_r17_r18_r19_r34_safefs_table(tree, case, op):
    root_path, outside = tree
    path, expected = TABLE[case]
    if case == "device" and not ROOT_ONLY:
        pytest.skip("mknod needs root")
    path = path.replace("<outside>", str(outside / SECRET_NAME)).replace("<root>", str(root_path))
    before = outside_state(outside)
    want = expected[op]
    with safefs.Root(root_path) as root:
        if case.endswith("dir_swapped_for_link"):
            swap_for_link(root_path, outside)      # after the root was opened: mid-call for the tree
        if want == OK:
            got = run(root, op, path)
        else:
            with pytest.raises(AfeError) as ei:
                run(root, op, path)
            assert type(ei.value) is want, f"{case}/{op}: {type(ei.value).__name__}: {ei.value}"
            got = str(ei.value)
    if want == OK:   # nothing read from outside: no content, no name
        assert SECRET not in repr(got).encode() and SECRET_NAME not in repr(got) and "kept.txt" not in repr(got)
    else:            # an error names the path, never content
        assert SECRET.decode() not in got and INSIDE.decode() not in got
    # nothing outside the root changed: names, content, owners
    assert outside_state(outside) == before


def test_r18_table_is_complete():
    """Every operation has an expectation for every case (no silent gaps)."""
    assert all(set(expected) == set(OPS) for _path, expected in TABLE.values())


# -- positive controls: the naive version of each operation escapes ---------------

def naive(root: Path, path: str) -> str:
    return os.path.join(root, path)


@pytest.mark.parametrize("path", [f"../outside/{SECRET_NAME}", f"esc/{SECRET_NAME}", "esc_file", "<outside>"])
def test_r17_r19_positive_control_naive_open_and_read_escape(tree, path):
    root, outside = tree
    path = path.replace("<outside>", str(outside / SECRET_NAME))
    fd = os.open(naive(root, path), os.O_RDONLY)
    try:
        assert os.read(fd, 100) == SECRET
    finally:
        os.close(fd)


def test_r19_positive_control_naive_write_through_dangling_link_creates_outside(tree):
    root, outside = tree
    with open(naive(root, "dangling"), "wb") as f:
        f.write(b"x")
    assert (outside / "created.txt").exists()


@pytest.mark.parametrize("path", ["esc", "swapped"])
def test_r19_positive_control_naive_list_and_walk_escape(tree, path):
    root, outside = tree
    swap_for_link(root, outside)
    assert SECRET_NAME in os.listdir(naive(root, path))
    walked = [name for _d, _dirs, files in os.walk(naive(root, path)) for name in files]
    assert SECRET_NAME in walked and "kept.txt" in walked


def test_r19_positive_control_naive_remove_escapes(tree):
    root, outside = tree
    os.remove(naive(root, f"esc/{SECRET_NAME}"))
    assert not (outside / SECRET_NAME).exists()


@pytest.mark.skipif(not ROOT_ONLY, reason="chown needs root")
def test_r19_positive_control_naive_chown_escapes(tree):
    root, outside = tree
    os.chown(naive(root, "esc_file"), OWNER, OWNER)
    assert os.stat(outside / SECRET_NAME).st_uid == OWNER


def test_r19_r34_directory_swapped_for_a_link_mid_walk_is_not_followed(tree):
    """The sandbox swaps a directory for a link after the walk saw it as a
    directory and before it enters it: safefs skips it; os.walk follows it."""
    root, outside = tree
    seen: list[bytes] = []
    fd = os.open(root, safefs.DIR_FLAGS)
    try:
        for item in safefs.walk(fd, LIMITS, descend=lambda it: it.name != b"deep"):
            seen.append(item.rel)
            if item.rel == b"swapped":
                assert item.is_dir
                swap_for_link(root, outside)
    finally:
        os.close(fd)
    assert b"swapped" in seen and not any(r.startswith(b"swapped/") for r in seen)
    assert not any(SECRET_NAME.encode() in r or b"kept.txt" in r for r in seen)


def path_walk(top: Path):
    """The naive walk: an entry's type from the listing, then the directory
    entered by its path (os.walk does the same, with an islink check in
    between that a sandbox can race)."""
    stack = [str(top)]
    while stack:
        with os.scandir(stack.pop()) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            is_dir = e.is_dir(follow_symlinks=False)
            yield e, is_dir
            if is_dir and e.name != "deep":
                stack.append(e.path)


def test_r19_r34_positive_control_path_walk_follows_a_directory_swapped_mid_walk(tree):
    root, outside = tree
    names = []
    for entry, is_dir in path_walk(root):
        names.append(entry.name)
        if entry.name == "swapped":
            assert is_dir
            swap_for_link(root, outside)      # seen as a directory, then entered by its path
    assert SECRET_NAME in names and "kept.txt" in names


@pytest.mark.skipif(not ROOT_ONLY, reason="chown needs root")
def test_r34_chown_changes_links_themselves_and_stops_at_the_limit(tree):
    """The one ownership fix-up: links changed, never followed; a tree deeper
    than the limit fails naming it, and nothing outside changes."""
    root, outside = tree
    before = outside_state(outside)
    with pytest.raises(TreeTooLarge) as ei:
        safefs.chown_tree(root, OWNER, OWNER, LIMITS)
    assert "deeper than 256 directories (limit of the safefs table)" in ei.value.message
    safefs.remove_tree(root / "deep")
    changed = safefs.chown_tree(root, OWNER, OWNER, LIMITS)
    assert changed > 0 and os.lstat(root / "esc").st_uid == OWNER and os.lstat(root / "esc_file").st_uid == OWNER
    assert outside_state(outside) == before


@pytest.mark.slow
def test_r34_remove_takes_any_depth_and_positive_control_fwalk_recurses(tmp_path):
    top = tmp_path / "w"
    top.mkdir()
    make_chain(top, 5000)
    with pytest.raises(RecursionError):       # the naive walk cannot even go through it
        for _ in os.fwalk(top, follow_symlinks=False):
            pass
    fd = os.open(top, safefs.DIR_FLAGS)
    try:
        with pytest.raises(TreeTooLarge):
            for _ in safefs.walk(fd, LIMITS):
                pass
    finally:
        os.close(fd)
    safefs.remove_tree(top)
    assert not top.exists()


def test_remove_dirs_except_removes_only_folders_not_kept(tmp_path):
    from services.common import safefs
    root = tmp_path / "root"
    (root / "live").mkdir(parents=True)
    (root / "gone" / "deep").mkdir(parents=True)
    (root / "file").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    assert safefs.remove_dirs_except(root, {"live"}) == {"gone"}
    assert sorted(p.name for p in root.iterdir()) == ["file", "link", "live"] and outside.is_dir()
    assert safefs.remove_dirs_except(tmp_path / "missing", set()) == set()
