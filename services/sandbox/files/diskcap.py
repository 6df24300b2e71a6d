"""The workspace disk cap (R34): a sandbox cannot fill the host's disk.

Two modes, chosen once when the broker starts (`detect_mode`) and logged:

- `mount` (the broker is root in Docker's mount namespace, loop devices
  exist): the workspace becomes its own filesystem. At the first create of
  a ticket's sandbox the broker makes a sparse image file
  `<data>/workspaces/.<ticket>.img` (root, 0600; no sandbox mounts the
  workspaces folder itself) of the cap's size, formats it ext4 without a
  journal, loop-mounts it `nosuid,nodev` OVER the checkout directory, copies
  the checkout from the directory it now hides (through a directory fd
  opened before the mount) and deletes the hidden originals. Writing past
  the cap then fails inside the sandbox with ENOSPC; nothing else on the
  host is touched. Destroy and reconcile unmount it (lazily when busy),
  which detaches the loop device, and remove the image.
- `watchdog` (the broker is not root, e.g. the systemd deployment whose
  sandbox broker is its own user with a private mount namespace, or no loop
  devices): every second the broker measures the workspace (st_blocks, an
  iterative walk bounded in depth and entries) and, past the cap, stops the
  sandbox's processes; every later call for the ticket fails naming the
  cap. This bounds the overshoot by what the sandbox writes in about one
  second, not to the byte.

All walks here go through `services.common.safefs`: iterative, never
following a symlink, the copy and the measurement bounded in depth and
entries (`COPY_LIMITS`, `USAGE_LIMITS`), the removal of the hidden originals
unbounded in depth.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from services.common import safefs
from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.common.host.mountinfo import Mount, mounts

log = logging.getLogger(__name__)

MODE_MOUNT = "mount"
MODE_WATCHDOG = "watchdog"

DEFAULT_DISK = 10 * 1024 ** 3
MIN_DISK = 16 * 1024 ** 2          # the same bounds as the manifest (services/common/config/manifests.py)
MAX_DISK = 16 * 1024 ** 4
WATCH_INTERVAL_S = 1.0

_TOOLS_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def resolve_disk(disk_bytes: int) -> int:
    """0 means the default (10g); the manifest already refused bad values,
    this refuses them from any other caller of the contract."""
    if disk_bytes == 0:
        return DEFAULT_DISK
    if disk_bytes < MIN_DISK:
        raise InvalidArgument("sandbox.limits.disk must be at least 16m (0 means the default, 10g)")
    if disk_bytes > MAX_DISK:
        raise InvalidArgument("sandbox.limits.disk must be at most 16t")
    return int(disk_bytes)


def format_size(n: int) -> str:
    """Bytes as the manifest would write them: 64m, 10g, 1536k."""
    for unit, size in (("t", 1024 ** 4), ("g", 1024 ** 3), ("m", 1024 ** 2), ("k", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}"


def cap_reason(cap: int) -> str:
    return (f"the workspace used more than its disk cap of {format_size(cap)} (sandbox.limits.disk): "
            "the sandbox was stopped; write less or raise sandbox.limits.disk in the Workspace manifest")


# -- mode ----------------------------------------------------------------------

def detect_mode() -> tuple[str, str]:
    """(mode, why): `mount` only when a loop mount made here is what Docker
    will bind into the sandbox."""
    if os.geteuid() != 0:
        return MODE_WATCHDOG, "the sandbox broker is not root, so it cannot mount a capped filesystem"
    missing = [t for t in ("mkfs.ext4", "mount", "umount", "losetup")
               if shutil.which(t, path=_TOOLS_ENV["PATH"]) is None]
    if missing:
        return MODE_WATCHDOG, f"{', '.join(missing)} not installed (Debian: e2fsprogs, mount)"
    if not os.path.exists("/dev/loop-control"):
        return MODE_WATCHDOG, "no loop devices (/dev/loop-control is missing)"
    host = os.environ.get("DOCKER_HOST", "")
    if host and not host.startswith("unix://"):
        return MODE_WATCHDOG, "Docker is not local (DOCKER_HOST), so it cannot see the broker's mounts"
    try:
        ours = os.readlink("/proc/self/ns/mnt")
        theirs = os.readlink(f"/proc/{_docker_pid()}/ns/mnt")
    except (OSError, ValueError):
        return MODE_WATCHDOG, "cannot tell whether Docker shares the broker's mount namespace"
    if ours != theirs:
        return MODE_WATCHDOG, "the broker runs in a private mount namespace that Docker does not see"
    return MODE_MOUNT, "loop-mounted ext4 image per workspace"


def _docker_pid() -> int:
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/var/run/docker.pid").read_text().strip())
    return 1


def _run(argv: list[str], what: str) -> subprocess.CompletedProcess[bytes]:
    res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, env=_TOOLS_ENV,
                         timeout=120, check=False)
    if res.returncode != 0:
        err = res.stderr.decode("utf-8", "replace").strip()[-300:]
        log.error("%s failed (exit %s): %s", what, res.returncode, err)
        raise Unavailable(f"{what} failed for a workspace disk cap (see the sandbox broker log)")
    return res


class DiskCaps:
    """The caps of one data folder's workspaces."""

    def __init__(self, workspaces_dir: Path, mode: str | None = None, why: str = "") -> None:
        self.workspaces_dir = Path(workspaces_dir)
        if mode is None:
            mode, why = detect_mode()
        if mode not in (MODE_MOUNT, MODE_WATCHDOG):
            raise InvalidArgument(f"disk cap mode must be {MODE_MOUNT} or {MODE_WATCHDOG}")
        self.mode = mode
        self.why = why or "chosen by the broker's caller"

    def image_path(self, ticket_id: str) -> Path:
        return self.workspaces_dir / f".{ticket_id}.img"

    def mounted(self, path: Path) -> list[Mount]:
        target = str(path)
        return [m for m in mounts() if m.target == target]

    def is_capped(self, ticket_id: str, path: Path) -> bool:
        return bool(self.mounted(path)) and self.image_path(ticket_id).exists()

    # -- mount mode ---------------------------------------------------------
    def ensure_mounted(self, ticket_id: str, path: Path, cap: int, *, create: bool = True) -> bool:
        """Make `path` (an existing directory) a filesystem of `cap` bytes
        holding what it held. Idempotent; True when capped by a mount. With
        `create` False only an existing image is mounted again (a container
        already binds the directory: its content must stay where it is)."""
        if self.mode != MODE_MOUNT:
            return False
        image = self.image_path(ticket_id)
        if self.mounted(path):
            return True
        if image.exists():
            # after a host restart: the content lives in the image
            self._mount(image, path)
            log.info("workspace disk image of %s mounted again", ticket_id)
            return True
        if not create:
            return False
        t0 = time.monotonic()
        old_fd = os.open(path, safefs.DIR_FLAGS)
        try:
            self._make_image(image, cap)
            try:
                self._mount(image, path)
                new_fd = os.open(path, safefs.DIR_FLAGS)
                try:
                    if os.fstat(new_fd).st_dev == os.fstat(old_fd).st_dev:
                        raise Unavailable("the workspace disk image did not mount over the workspace")
                    with contextlib.suppress(FileNotFoundError):
                        os.rmdir("lost+found", dir_fd=new_fd)
                    try:
                        copied = copy_tree(old_fd, new_fd)
                    except OSError as exc:
                        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                            raise FailedPrecondition(
                                f"the ticket's checkout does not fit in sandbox.limits.disk "
                                f"({format_size(cap)}); raise it in the Workspace manifest") from exc
                        raise
                finally:
                    os.close(new_fd)
            except BaseException:
                self._unmount(path)
                image.unlink(missing_ok=True)
                raise
            removed = remove_contents(old_fd)
        finally:
            os.close(old_fd)
        log.info("workspace of %s capped at %s (copied %d entries, freed %d, %.0f ms)", ticket_id,
                 format_size(cap), copied, removed, (time.monotonic() - t0) * 1000)
        return True

    def _make_image(self, image: Path, cap: int) -> None:
        image.unlink(missing_ok=True)
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, cap)      # sparse: blocks are taken only as the sandbox writes
        finally:
            os.close(fd)
        try:
            _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal",
                  "-E", "lazy_itable_init=1,lazy_journal_init=1", str(image)], "mkfs.ext4")
        except BaseException:
            image.unlink(missing_ok=True)
            raise

    def _mount(self, image: Path, path: Path) -> None:
        # noinit_itable: the inode tables of a fresh sparse image are holes
        # (zeros) already; the kernel need not write them out.
        _run(["mount", "-t", "ext4", "-o", "loop,nosuid,nodev,noinit_itable", str(image), str(path)],
             "mount")

    def _unmount(self, path: Path) -> int:
        """Unmount every mount stacked on `path`. A container just removed
        can hold it for a moment: retried for up to ~2 s, then detached
        lazily (the kernel frees it when its last user goes)."""
        n = 0
        for attempt in range(40):
            if not self.mounted(path) or n >= 8:
                break
            res = subprocess.run(["umount", str(path)], stdin=subprocess.DEVNULL, capture_output=True,
                                 env=_TOOLS_ENV, timeout=60, check=False)
            if res.returncode == 0:
                n += 1
            elif attempt >= 20:
                _run(["umount", "-l", str(path)], "umount -l")
                n += 1
            else:
                time.sleep(0.1)
        return n

    def _loops_of(self, image: Path) -> list[str]:
        res = subprocess.run(["losetup", "-j", str(image), "-O", "NAME", "-n"], stdin=subprocess.DEVNULL,
                             capture_output=True, env=_TOOLS_ENV, timeout=30, check=False)
        return res.stdout.decode().split()

    def _detach_loops(self, image: Path) -> None:
        """mount -o loop sets autoclear, which the kernel carries out a moment
        after the unmount: wait for it (bounded, ~5 s), then detach what is
        left (a lazy unmount still in use keeps its device until the last
        user goes; autoclear frees it then)."""
        for _ in range(50):
            if not self._loops_of(image):
                return
            time.sleep(0.1)
        for dev in self._loops_of(image):
            subprocess.run(["losetup", "-d", dev], stdin=subprocess.DEVNULL, capture_output=True,
                           env=_TOOLS_ENV, timeout=30, check=False)

    def release(self, ticket_id: str, path: Path) -> bool:
        """Unmount the ticket's image and remove it (its content goes with it:
        this is the end of the ticket). True when something was removed."""
        image = self.image_path(ticket_id)
        if not self.mounted(path) and not image.exists():
            return False
        self._unmount(path)
        if image.exists():
            self._detach_loops(image)
            image.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            os.rmdir(path)      # the folder under the mount, emptied when the checkout moved in
        log.info("workspace disk image of %s removed", ticket_id)
        return True

    def reconcile(self, live: Iterable[str], path_of: Callable[[str], Path]) -> list[str]:
        """Release the images and mounts of tickets not in `live`."""
        live = set(live)
        base = str(self.workspaces_dir) + "/"
        tickets = {m.target[len(base):] for m in mounts() if m.target.startswith(base)}
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.workspaces_dir):
                if e.name.startswith(".") and e.name.endswith(".img"):
                    tickets.add(e.name[1:-4])
        done = []
        for t in sorted(tickets - live):
            try:
                path = path_of(t)
            except InvalidArgument:
                continue
            if self.release(t, path):
                done.append(t)
        return done


# -- walks ---------------------------------------------------------------------
# Every walk goes through services/common/safefs (R34): iterative, never
# following a link, directories opened from their parent's fd.

COPY_LIMITS = safefs.Limits("the copy of the checkout into its disk-capped workspace")
USAGE_LIMITS = safefs.Limits("the disk cap watchdog's measurement")


def copy_tree(src_fd: int, dst_fd: int) -> int:
    """Copy the checkout under directory fd `src_fd` into the (empty) directory
    fd `dst_fd` (`safefs.copy_tree`: links as links, never followed; owners,
    modes without set-id bits, times), bounded by `COPY_LIMITS`."""
    return safefs.copy_tree(src_fd, dst_fd, COPY_LIMITS)


def remove_contents(dir_fd: int) -> int:
    """Delete everything under directory fd `dir_fd` (not the directory
    itself), whatever its depth, never following a symlink
    (`safefs.empty_dir`); returns entries removed."""
    return safefs.empty_dir(dir_fd)


def usage(path: Path, limit: int) -> tuple[int, str]:
    """Bytes the tree under `path` takes on disk, stopping early past `limit`;
    with "" or the reason the walk was refused (`USAGE_LIMITS`: too deep, too
    many entries). See `safefs.disk_usage`."""
    return safefs.disk_usage(path, limit, USAGE_LIMITS)
