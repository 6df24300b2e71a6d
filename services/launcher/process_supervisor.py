"""Starting, watching and stopping the four child processes.

Each child is a separate OS process started with a clean environment, its
link secrets on an inherited pipe (never env or argv), and a status pipe on
which it writes one JSON readiness line. Children get PR_SET_PDEATHSIG, so a
SIGKILLed launcher does not leave them behind, and their own session, so a
terminal's Ctrl-C reaches only the launcher, which then stops them in order.

Everything runs on the launcher's main thread (PR_SET_PDEATHSIG is tied to
the thread that forked).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import FailedPrecondition
from services.common.rpc.links import LinkSecrets, pass_via_pipe

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 30.0
STABLE_AFTER = 60.0        # a child up this long has its back-off reset
STOP_GRACE = 7.0           # SIGTERM, then SIGKILL: all gone well within 10 s


def _pdeathsig(parent_pid: int) -> Callable[[], None]:
    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:      # the launcher died before prctl
            os._exit(1)
    return preexec


@dataclass
class ChildSpec:
    service: str                      # sandbox | credentials | scheduler | gateway
    argv: list[str]                   # without --link-fd / --status-fd
    env: dict[str, str]
    links: LinkSecrets

    def __repr__(self) -> str:        # never show env values or secrets
        return f"ChildSpec({self.service}, env={sorted(self.env)}, links={self.links!r})"


@dataclass
class Child:
    spec: ChildSpec
    proc: subprocess.Popen[bytes] | None = None
    status_fd: int | None = None
    ready: dict[str, Any] | None = None     # the child's ready line (JSON)
    started_at: float = 0.0
    restarts: int = 0
    backoff: float = BACKOFF_FIRST
    restart_at: float | None = None
    delays: list[float] = field(default_factory=list)   # back-off used before each restart
    _buf: bytes = field(default=b"", repr=False)

    @property
    def name(self) -> str:
        return self.spec.service

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        link_fd = pass_via_pipe(self.spec.links.to_json())
        status_r, status_w = os.pipe()
        os.set_inheritable(status_w, True)
        argv = [*self.spec.argv, "--link-fd", str(link_fd), "--status-fd", str(status_w)]
        try:
            self.proc = subprocess.Popen(
                argv, env=self.spec.env, pass_fds=(link_fd, status_w), close_fds=True,
                stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_pdeathsig(os.getpid()))  # noqa: PLW1509 - single-threaded launcher
        finally:
            os.close(link_fd)
            os.close(status_w)
        self.status_fd = status_r
        os.set_blocking(status_r, False)
        self.ready = None
        self._buf = b""
        self.started_at = time.monotonic()
        self.restart_at = None
        log.info("started %s (pid %s)", self.name, self.proc.pid)

    def poll_status(self) -> bool:
        """Read what is available on the status pipe; True once the ready line arrived."""
        if self.ready is not None:
            return True
        if self.status_fd is None:
            return False
        try:
            while True:
                chunk = os.read(self.status_fd, 4096)
                if not chunk:
                    self._close_status()
                    break
                self._buf += chunk
                if b"\n" in self._buf:
                    break
        except BlockingIOError:
            pass
        if b"\n" in self._buf:
            line = self._buf.split(b"\n", 1)[0]
            try:
                self.ready = json.loads(line)
            except ValueError:
                self.ready = {}
            self._close_status()
            return True
        return False

    def _close_status(self) -> None:
        if self.status_fd is not None:
            os.close(self.status_fd)
            self.status_fd = None

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)


class Supervisor:
    """Starts children in order, restarts crashed ones with back-off, stops them all."""

    def __init__(self, specs: list[ChildSpec], ready_timeout: float = 90.0,
                 backoff_first: float = BACKOFF_FIRST, backoff_max: float = BACKOFF_MAX) -> None:
        self.children = [Child(s, backoff=backoff_first) for s in specs]
        self.ready_timeout = ready_timeout
        self.backoff_first = backoff_first
        self.backoff_max = backoff_max
        self.stopping = False

    def child(self, service: str) -> Child:
        for c in self.children:
            if c.name == service:
                return c
        raise KeyError(service)

    def start_all(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Start each child and wait for its readiness line before the next one."""
        for c in self.children:
            c.start()
            self._wait_ready(c, should_stop)

    def _wait_ready(self, c: Child, should_stop: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while not c.poll_status():
            if should_stop():
                raise FailedPrecondition("interrupted while starting")
            code = c.exited()
            if code is not None:
                raise FailedPrecondition(f"the {c.name} process exited with code {code} before it was ready; "
                                         "its log lines above say why")
            if time.monotonic() > deadline:
                raise FailedPrecondition(f"the {c.name} process did not report ready within "
                                         f"{self.ready_timeout:.0f} s; its log lines above say why")
            if c.status_fd is not None:
                select.select([c.status_fd], [], [], 0.2)
            else:
                time.sleep(0.1)

    def tick(self, timeout: float = 0.5) -> None:
        """One supervision step: notice exits, restart due children, read readiness lines."""
        now = time.monotonic()
        for c in self.children:
            if self.stopping:
                return
            if c.restart_at is None:
                code = c.exited()
                if code is not None:
                    if c.status_fd is not None:
                        c._close_status()
                    if now - c.started_at > STABLE_AFTER:
                        c.backoff = self.backoff_first
                    c.restart_at = now + c.backoff
                    log.warning("%s (pid %s) exited with code %s; restarting in %.1f s",
                                c.name, c.pid, code, c.backoff)
                    c.delays.append(c.backoff)
                    c.backoff = min(c.backoff * 2, self.backoff_max)
            elif now >= c.restart_at:
                c.restarts += 1
                log.info("restarting %s (restart #%d)", c.name, c.restarts)
                try:
                    c.start()
                except OSError as exc:
                    log.error("could not restart %s: %s", c.name, exc)
                    c.restart_at = now + c.backoff
            c.poll_status()
        fds = [c.status_fd for c in self.children if c.status_fd is not None]
        if fds:
            select.select(fds, [], [], timeout)
        else:
            time.sleep(timeout)

    def stop_all(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM the children in reverse start order, each after the one before
        it has exited: callers stop before the brokers they call, so a stopping
        scheduler can still have a terminal ticket's sandbox removed (R12). Each
        child keeps a share of `grace` for those after it; SIGKILL what is left
        after `grace` seconds."""
        self.stopping = True
        deadline = time.monotonic() + grace
        order = [(c, c.proc) for c in reversed(self.children) if c.proc is not None]
        reserve = grace / (2 * max(1, len(order)))      # kept for each child still to stop
        for i, (c, proc) in enumerate(order):
            c.signal(signal.SIGTERM)
            until = deadline - reserve * (len(order) - 1 - i)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, until - time.monotonic()))
        for c, proc in order:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", c.name, grace)
                c.signal(signal.SIGKILL)
        for c in self.children:
            if c.proc is not None:
                try:
                    c.proc.wait(2)
                except subprocess.TimeoutExpired:
                    log.error("%s (pid %s) survived SIGKILL", c.name, c.pid)
            c._close_status()
