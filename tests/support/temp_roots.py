"""The tests' own temporary folders, and the workspace disk caps (R34) left in them.

A sandbox broker in mount mode loop-mounts `<data>/workspaces/.<ticket>.img`
over `<data>/workspaces/<ticket>`. A test that deletes its data folder while
such a mount is live (a broker killed, or stopped with a ticket's sandbox
still there) leaves the mount and its loop device behind, and
`shutil.rmtree` even empties the mounted filesystem and unlinks the image
under it (`losetup -a` then shows it "(deleted)").

    base = temp_root("afe-r12-")         # /tmp/afe-r12-XXXX, known to the safety net
    ...
    left = remove_temp_root(base)        # releases what the disk cap left, then removes the folder

`release_disk_caps` touches only mounts and loop devices whose backing image
lives under the folders it is given: never anything of another test run or
of the host. tests/conftest.py runs it at the end of the session over every
folder made here and pytest's base temp, and warns about what it found.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from pathlib import Path

from services.common import treewalk
from services.common.host import mountinfo

_ROOTS: list[Path] = []
_TOOLS_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def temp_root(prefix: str) -> Path:
    """A new folder under /tmp (short, for Unix socket paths), registered as the tests' own."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    _ROOTS.append(d)
    return d


def temp_roots() -> list[Path]:
    """Every folder `temp_root` made in this process."""
    return list(_ROOTS)


def remove_temp_root(root: Path) -> list[str]:
    """Release the disk caps left under `root`, then remove it whatever its
    depth (R34 trees break `shutil.rmtree`). Returns what was left (see
    `release_disk_caps`)."""
    left = release_disk_caps([root])
    with contextlib.suppress(OSError):
        treewalk.remove_tree(root)
    return left


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def loops_under(roots: list[Path]) -> dict[str, str]:
    """{"/dev/loopN": backing image} for loop devices whose image lives under `roots`."""
    rs = [os.path.realpath(r) for r in roots]
    found = {}
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir("/sys/block")):
            try:
                backing = Path(f"/sys/block/{name}/loop/backing_file").read_text().rstrip("\n")
            except OSError:
                continue        # not a loop device, or not attached
            image = backing.removesuffix(" (deleted)")
            if _under(image, rs):
                found[f"/dev/{name}"] = backing
    return found


def disk_caps_left(roots: list[Path]) -> list[str]:
    """A line per mount and loop device whose backing image lives under `roots`."""
    loops = loops_under(roots)
    lines = [f"mount {m.target} (image {loops[m.source]})" for m in mountinfo.mounts() if m.source in loops]
    return lines + [f"loop device {dev} (image {img})" for dev, img in loops.items()]


def release_disk_caps(roots: list[Path]) -> list[str]:
    """Unmount every mount whose loop image lives under `roots` (lazily when
    still busy), detach those loop devices; returns what was there before."""
    left = disk_caps_left(roots)
    if not left:
        return []
    for _ in range(8):      # mounts may be stacked on one directory
        loops = loops_under(roots)
        targets = sorted({m.target for m in mountinfo.mounts() if m.source in loops}, key=len, reverse=True)
        if not targets:
            break
        for target in targets:
            if subprocess.run(["umount", target], capture_output=True, env=_TOOLS_ENV, check=False).returncode:
                subprocess.run(["umount", "-l", target], capture_output=True, env=_TOOLS_ENV, check=False)
    for _ in range(50):     # autoclear detaches a loop device a moment after its unmount
        if not loops_under(roots):
            break
        time.sleep(0.1)
    for dev in loops_under(roots):
        subprocess.run(["losetup", "-d", dev], capture_output=True, env=_TOOLS_ENV, check=False)
    return left
