"""The automation key follows its file, so `afe token rotate --automation`
takes effect on a running scheduler.

`afe up` hands the scheduler the `automation` caller's key on the link fd and
writes the same key to `<run>/automation.key` (0600). While it serves, the
scheduler looks at that file twice a second; when it holds a different
well-formed key, the key the scheduler accepts from automation is replaced
at once: every call made after that with the old key gets PERMISSION_DENIED
(streams already open run to their end). The file is believed only when it
is a regular file of our own user with no group or other permission bits;
otherwise, or when it is missing or malformed, the current key stays and the
reason is logged. A restarted scheduler reads the file before it serves, so a
rotation survives the launcher's restart of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from pathlib import Path

from services.common.rpc.grpcutil import CallerSecrets

log = logging.getLogger(__name__)

CALLER = "automation"
KEY_BYTES = 32
POLL_S = 0.5


class AutomationKeyFile:
    def __init__(self, path: Path, accepted: CallerSecrets, poll_s: float = POLL_S) -> None:
        self.path = path
        self.accepted = accepted
        self.poll_s = poll_s
        self._seen: tuple[int, int, int] | None = None
        self._task: asyncio.Task[None] | None = None

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def load(self) -> bool:
        """Adopt the file's key if it is well formed and differs; True if replaced."""
        self._seen = self._signature()
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("automation key file %s cannot be read (%s); the current key stays", self.path,
                        exc.strerror)
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                log.warning("automation key file %s is not a private (0600) file of this user; the current "
                            "key stays", self.path)
                return False
            raw = os.read(fd, 4 * KEY_BYTES)
        finally:
            os.close(fd)
        try:
            key = bytes.fromhex(raw.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            key = b""
        if len(key) != KEY_BYTES:
            log.warning("automation key file %s does not hold %d hex-encoded bytes; the current key stays",
                        self.path, KEY_BYTES)
            return False
        if key == self.accepted.get(CALLER):
            return False
        self.accepted.replace(CALLER, key)
        log.info("automation key replaced from %s", self.path)
        return True

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            if self._signature() != self._seen:
                self.load()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._follow(), name="automation-key")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
