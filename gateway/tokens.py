"""The UI token: where it comes from, and noticing when it changes.

The token is either fixed for the process's life (AFE_UI_TOKEN) or read from
a 0600 file that `afe token rotate` replaces. The file is watched by
`stat` (inode, size, mtime): every authentication decision asks for the
current token, and a background poller notices a rotation promptly so open
sessions can be closed (R21).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from services.common.errors import ConfigError
from services.common.secrecy.redact import Redactor

log = logging.getLogger(__name__)

MIN_TOKEN_LENGTH = 16


def _check(token: str, where: str) -> str:
    token = token.strip()
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(f"the UI token in {where} is shorter than {MIN_TOKEN_LENGTH} characters; "
                          "run `afe token rotate` to write a new one")
    return token


class TokenSource:
    """Gives the current token; calls listeners when it changes."""

    def __init__(self, redactor: Redactor, *, fixed: str | None = None, path: Path | None = None,
                 poll_interval: float = 0.5) -> None:
        if fixed is None and path is None:
            raise ConfigError("the gateway needs AFE_UI_TOKEN or --token-file")
        self._redactor = redactor
        self._path = path
        self._fixed = fixed is not None
        self._stamp: tuple[int, int, int] | None = None
        self._token = ""
        self._generation = 0
        self._listeners: list[Callable[[], None]] = []
        self._poll_interval = poll_interval
        self._task: asyncio.Task[None] | None = None
        if fixed is not None:
            self._set(_check(fixed, "AFE_UI_TOKEN"))
        else:
            self._reload(initial=True)

    @property
    def generation(self) -> int:
        """Increases every time the token changes."""
        return self._generation

    def _set(self, token: str) -> None:
        self._redactor.register(token)
        self._token = token
        self._generation += 1

    def _stat(self) -> tuple[int, int, int]:
        assert self._path is not None
        st = os.stat(self._path)
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _reload(self, initial: bool = False) -> bool:
        """Re-read the file if it changed; True when the token changed."""
        assert self._path is not None
        try:
            stamp = self._stat()
        except FileNotFoundError:
            if initial:
                raise ConfigError(f"token file {self._path} does not exist; "
                                  "run `afe token rotate` to create it") from None
            return False
        if stamp == self._stamp:
            return False
        mode = os.stat(self._path).st_mode & 0o777
        if mode & 0o077:
            log.warning("token file %s has mode %o; it should be 0600", self._path, mode)
        try:
            token = _check(self._path.read_text(encoding="utf-8"), str(self._path))
        except (ConfigError, UnicodeDecodeError) as exc:
            if initial:
                raise ConfigError(f"token file {self._path} is not usable: {exc}") from None
            log.warning("token file %s changed but is not usable; keeping no token until it is fixed",
                        self._path)
            self._stamp = stamp
            self._token = ""
            self._generation += 1
            return True
        self._stamp = stamp
        if token == self._token:
            return False
        self._set(token)
        return True

    def current(self) -> str:
        """The token now ("" when the file is unusable: every login fails)."""
        if not self._fixed and self._reload():
            self._notify()
        return self._token

    def on_change(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def _notify(self) -> None:
        log.info("the UI token changed; existing sessions end now")
        for fn in list(self._listeners):
            try:
                fn()
            except Exception:
                log.exception("token change listener failed")

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval)
            self.current()

    def start(self) -> None:
        if not self._fixed and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
