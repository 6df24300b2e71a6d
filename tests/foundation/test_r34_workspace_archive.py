"""The workspace as a tar stream across hosts (services/common/safefs/archive.py).

Hostile archives are refused on both sides: the sandbox broker unpacking a
checkout into a ticket's workspace (`services.sandbox.files.handover.Handover.write`)
and the credential broker unpacking a sandbox's workspace into its private
copy (`services.credentials.workspaces.handover.unpacked`). Every case runs on both, and
each attack has a positive control: Python's `tarfile` with the
`fully_trusted` filter (its default before 3.14) does what the archive asks.
Reading (`pack`) stores links as links and never follows one.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from services.common import safefs
from services.common.errors import AfeError
from services.common.layout import Layout
from services.common.safefs import archive
from services.credentials.workspaces import handover as cred_handover
from services.sandbox.files.handover import Handover, is_git_dir_name


def _ti(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0, link: str = "") -> tarfile.TarInfo:
    t = tarfile.TarInfo(name)
    t.type, t.size, t.linkname = kind, size, link
    if kind == tarfile.CHRTYPE:
        t.devmajor, t.devminor = 1, 3
    return t


def _tar(*entries: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for info, data in entries:
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


async def _chunks(data: bytes, size: int = 700):
    for i in range(0, len(data), size):
        yield data[i:i + size]


async def _sandbox_side(tmp: Path, data: bytes, disk: int = 0) -> Path:
    layout = Layout(tmp / "sb-data", tmp / "sb-run")
    await Handover(layout).write("t-arch", disk, _chunks(data))
    return layout.workspace("t-arch")


async def _credentials_side(tmp: Path, data: bytes, limits: archive.ArchiveLimits | None = None) -> Path:
    layout = Layout(tmp / "cb-data", tmp / "cb-run")
    keep = tmp / "kept"
    async with cred_handover.unpacked(layout, _chunks(data), limits or cred_handover.UNPACK_LIMITS) as work:
        safefs.copy_tree(os.open(work, safefs.DIR_FLAGS), os.open(_mk(keep), safefs.DIR_FLAGS),
                         safefs.Limits("test"))
    assert not any((layout.data_dir / "handover").iterdir())     # the private copy is gone at once
    return keep


def _mk(p: Path) -> Path:
    p.mkdir()
    return p


SIDES = {"sandbox": _sandbox_side, "credentials": _credentials_side}


def _outside(tmp: Path) -> Path:
    out = tmp / "outside"
    out.mkdir(exist_ok=True)
    (out / "secret").write_text("host file")
    return out


# (case, archive maker(tmp) -> bytes, what the refusal says, did-it-escape check(tmp, dest) for the control)
def _dotdot(tmp):
    return _tar((_ti("../escaped", size=2), b"hi"))


def _absolute(tmp):
    return _tar((_ti(str(_outside(tmp) / "abs"), size=2), b"hi"))


def _through_link(tmp):
    return _tar((_ti("evil", tarfile.SYMTYPE, link=str(_outside(tmp))), None), (_ti("evil/pwned", size=2), b"hi"))


def _hard_link(tmp):
    return _tar((_ti("h", tarfile.LNKTYPE, link=str(_outside(tmp) / "secret")), None))


def _device(tmp):
    return _tar((_ti("null", tarfile.CHRTYPE), None))


CASES = [
    ("dotdot", _dotdot, "'..'", lambda tmp, dest: (dest.parent / "escaped").exists()),
    ("absolute", _absolute, "absolute", lambda tmp, dest: (tmp / "outside" / "abs").exists()),
    ("write_through_link", _through_link, "link", lambda tmp, dest: (tmp / "outside" / "pwned").exists()),
    ("hard_link_to_outside", _hard_link, "hard link", lambda tmp, dest: os.stat(dest / "h").st_nlink > 1
     and os.path.samefile(dest / "h", tmp / "outside" / "secret")),
    ("device_file", _device, "device", lambda tmp, dest: stat.S_ISCHR(os.lstat(dest / "null").st_mode)),
]


@pytest.mark.parametrize("case,make,says,escaped", CASES, ids=[c[0] for c in CASES])
def test_r19_control_tarfile_does_what_a_hostile_archive_asks(tmp_path, case, make, says, escaped):
    """Positive control: without our unpacker each archive escapes (or makes a device)."""
    dest = _mk(tmp_path / "naive")
    with tarfile.open(fileobj=io.BytesIO(make(tmp_path))) as t:
        t.extractall(dest, filter="fully_trusted")
    assert escaped(tmp_path, dest)


@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize("case,make,says,escaped", CASES, ids=[c[0] for c in CASES])
async def test_r18_r19_hostile_archive_is_refused(tmp_path, side, case, make, says, escaped):
    with pytest.raises(AfeError, match=says):
        await SIDES[side](tmp_path, make(tmp_path))
    if (tmp_path / "outside").exists():
        assert sorted(p.name for p in (tmp_path / "outside").iterdir()) == ["secret"]
    assert not (tmp_path / "escaped").exists()
    if side == "sandbox":   # nothing half-written stays: the workspace is not made, the temp folder is gone
        ws = tmp_path / "sb-data" / "workspaces"
        assert [p.name for p in ws.iterdir()] == []


def _good() -> bytes:
    return _tar((_ti("src", tarfile.DIRTYPE), None), (_ti("src/a.py", size=6), b"print\n"),
                (_ti("link", tarfile.SYMTYPE, link="/etc/passwd"), None),
                (_ti("src/" + "n" * 150, size=1), b"x"))


@pytest.mark.parametrize("side", list(SIDES))
async def test_r19_control_a_plain_archive_unpacks_links_kept_as_links(tmp_path, side):
    dest = await SIDES[side](tmp_path, _good())
    assert (dest / "src" / "a.py").read_bytes() == b"print\n"
    assert os.readlink(dest / "link") == "/etc/passwd"      # stored as a link, never followed
    assert (dest / "src" / ("n" * 150)).read_bytes() == b"x"


@pytest.mark.slow
@pytest.mark.parametrize("side", list(SIDES))
async def test_r34_deep_archive_is_refused(tmp_path, side):
    deep = [(_ti("/".join(["d"] * i), tarfile.DIRTYPE), None) for i in range(1, 300)]
    with pytest.raises(AfeError, match="deeper than 256"):
        await SIDES[side](tmp_path, _tar(*deep))
    ok = await SIDES[side](_mk(tmp_path / "ok"), _tar(*deep[:200]))
    assert (ok / "/".join(["d"] * 199)).is_dir()                # control: within the limit it unpacks


@pytest.mark.slow
async def test_r34_huge_entry_is_refused_by_the_disk_cap(tmp_path):
    big = _tar((_ti("big", size=20 << 20), b"\0" * (20 << 20)))
    with pytest.raises(AfeError, match="more than 16 MiB"):
        await _sandbox_side(tmp_path, big, disk=16 << 20)
    ok = await _sandbox_side(_mk(tmp_path / "ok"), big, disk=32 << 20)
    assert (ok / "big").stat().st_size == 20 << 20              # control: a larger cap takes it


async def test_r34_huge_entry_is_refused_by_the_snapshot_file_limit(tmp_path):
    limits = archive.ArchiveLimits("test", max_file=1 << 20)
    data = _tar((_ti("big", size=2 << 20), b"\0" * (2 << 20)))
    with pytest.raises(AfeError, match="larger than 1 MiB"):
        await _credentials_side(tmp_path, data, limits)
    ok = await _credentials_side(_mk(tmp_path / "ok"), data, archive.ArchiveLimits("test", max_file=4 << 20))
    assert (ok / "big").stat().st_size == 2 << 20


async def test_r34_too_many_entries_and_big_pax_header_and_cut_stream_are_refused(tmp_path):
    many = _tar(*[(_ti(f"f{i}"), b"") for i in range(150)])
    with pytest.raises(AfeError, match="more than 100 files"):
        await _credentials_side(tmp_path, many, archive.ArchiveLimits("test", max_entries=100))
    pax = _tar((_ti("x", size=1), b"x"))
    info = _ti("p", size=1)
    info.pax_headers = {"comment": "c" * (archive.MAX_PAX + 10)}
    with pytest.raises(AfeError, match="PAX header is larger"):
        await _credentials_side(_mk(tmp_path / "pax"), _tar((info, b"x")))
    with pytest.raises(AfeError, match="ended in the middle"):
        await _credentials_side(_mk(tmp_path / "cut"), pax[:600])
    with pytest.raises(AfeError, match="given twice"):
        await _credentials_side(_mk(tmp_path / "dup"), _tar((_ti("a", size=1), b"1"), (_ti("a", size=1), b"2")))


def test_r19_pack_stores_links_as_links_and_never_follows_them(tmp_path):
    out = _outside(tmp_path)
    ws = _mk(tmp_path / "ws")
    (ws / "leak").symlink_to(out / "secret")
    (ws / "dirlink").symlink_to(out)
    os.mkfifo(ws / "fifo")                       # never opened (it would block)
    _mk(ws / ".git")
    (ws / ".git" / "config").write_text("scratch")
    data = b"".join(archive.pack_path(ws, archive.ArchiveLimits("test"), skip=is_git_dir_name))
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        members = {m.name: m for m in t.getmembers()}
    assert members["leak"].issym() and members["leak"].linkname == str(out / "secret")
    assert members["dirlink"].issym() and "dirlink/secret" not in members
    assert "fifo" not in members and ".git/config" not in members and members[".git"].isdir()
    assert b"host file" not in data
    # control: an archiver that follows links carries the host's file
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", dereference=True) as t:
        t.add(ws / "leak", arcname="leak")
    assert b"host file" in buf.getvalue()


def test_r34_pack_of_a_deep_tree_is_refused(tmp_path):
    ws = _mk(tmp_path / "ws")
    fd = os.open(ws, safefs.DIR_FLAGS)
    for _ in range(300):
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", safefs.DIR_FLAGS, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.close(fd)
    with pytest.raises(AfeError, match="deeper than 256"):
        b"".join(archive.pack_path(ws, archive.ArchiveLimits("test")))
    assert b"".join(archive.pack_path(ws, archive.ArchiveLimits("test", max_depth=400)))   # control
