"""Fast commands: one supervisor process per sandbox, fed over an attached
stream, instead of one `docker exec` per command.

A `docker exec` costs tens of milliseconds (the engine, containerd and runc
set up a process in the container's namespaces every time). The broker pays
that once per sandbox: it starts `command_supervisor_main.py` in the sandbox with one
exec (as the sandbox user, no extra environment, stdin attached) and sends it
commands over that exec's hijacked stream; a command then costs a fork in the
sandbox and a few frames.

Nothing is weaker than with an exec per command:
- the supervisor is a process of the sandbox like any other (same user,
  capabilities, cgroup limits, namespaces, seccomp, no-new-privileges);
- a command gets the sandbox's base environment plus exactly the entries the
  broker checked (R9), as an exec does; the supervisor keeps no value;
- timeouts, output caps and exit codes stay in the broker (execs.py);
- output and stdin are both flow controlled per command (bounded credit
  each way), so neither side buffers more than a window for a command
  that does not read, and a writer to a stuck stdin waits as on an exec;
  a kill is a SIGKILL of the command's process group, from the host when the
  broker may, else by the supervisor;
- a sandbox that kills or confuses its supervisor (it runs as the sandbox
  user, so it can) fails its own running commands with a clear message and
  nothing else: every frame is bounded and checked here, a protocol error
  ends the link, the orphaned process groups are killed, and the next command
  starts a new supervisor — or, after `MAX_RESTARTS`, goes back to one exec
  per command for that sandbox.

The broker's side of one command (its credit and stdin window) is in
supervised_command.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import struct
from pathlib import Path

from services.sandbox.commands.supervised_command import (
    IN_WINDOW,
    MAX_SEND,
    STOPPED,
    WINDOW,
    SupervisedCommand,
)
from services.sandbox.containers.dockerapi import STDERR, STDOUT, DockerAPI, EngineError, ExecStream
from services.sandbox.containers.nspids import host_pid_of, namespace_pid

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("command_supervisor_main.py").read_text()
MARKER = "# afe-supervisor"
HDR = struct.Struct(">BII")
CODE = struct.Struct(">i")
MAX_PAYLOAD = 1 << 20
HELLO_TIMEOUT_S = 15.0
START_TIMEOUT_S = 30.0
MAX_RESTARTS = 3

CLOSED = "the broker closed it"

# Run inside the sandbox (as its user) when a supervisor died with a command
# it had started but not yet reported (the command can kill its supervisor
# before the "started" frame is written): kill the sessions it left behind.
# Those are the sessions newer than every pid the link knew (argv[1]) whose
# leader is gone or was orphaned to the sandbox's init (pid 1); an exec's
# session (its leader's parent is outside the sandbox: ppid 0, e.g. a new
# supervisor) and a live supervisor's commands are not touched. Repeated
# until none is left, so a process forked meanwhile goes too.
SWEEP = r"""
import os, sys
low, me = int(sys.argv[1]), os.getsid(0)
for _ in range(20):
    procs = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/" + d + "/stat") as f:
                    st = f.read()
            except OSError:
                continue
            f = st[st.rindex(")") + 2:].split()
            procs[int(d)] = (int(f[1]), int(f[3]))
    doomed = [p for p, (_pp, sid) in procs.items() if sid > low and sid not in (1, me)
              and (sid not in procs or procs[sid][0] == 1)]
    if not doomed:
        break
    for p in doomed:
        try:
            os.kill(p, 9)
        except OSError:
            pass
"""


class SupervisorDown(Exception):
    """The link is gone (or never came up); the reason is in the message."""


class NoSupervisor(SupervisorDown):
    """The image cannot run the supervisor (no python3): use one exec per command."""


def argv(source: str = SOURCE) -> list[str]:
    # -I: no PYTHON* variable of the image and no user site reach the supervisor
    # (its commands still get the sandbox's whole environment); -S: no `site`
    # import, a few milliseconds off its start (it needs the standard library only)
    return ["python3", "-I", "-S", "-c", source]


class Link:
    """The broker's end of one sandbox's supervisor."""

    def __init__(self, api: DockerAPI, container_id: str, exec_id: str, stream: ExecStream) -> None:
        self.api = api
        self.container_id = container_id
        self.exec_id = exec_id
        self.stream = stream
        self.host_pid = 0
        self.high = 0                 # the highest pid in the sandbox this link knows (its own, its commands')
        self.cmds: dict[int, SupervisedCommand] = {}
        self.alive = True
        self.why = ""
        self._next = 1
        self._buf = bytearray()
        self._stderr = bytearray()
        self._hello: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, api: DockerAPI, container_id: str, source: str = SOURCE) -> Link:
        exec_id = await api.exec_create(container_id, argv(source), workdir="/", env=[], stdin=True)
        stream = await api.exec_start(exec_id, container=container_id)
        link = cls(api, container_id, exec_id, stream)
        link._reader = asyncio.get_running_loop().create_task(link._read())
        try:
            await asyncio.wait_for(asyncio.shield(link._hello), HELLO_TIMEOUT_S)
        except (TimeoutError, SupervisorDown):
            link._die("it did not start")
            code = -1
            with contextlib.suppress(Exception):
                code = (await api.exec_inspect(exec_id)).get("ExitCode") or -1
            if code in (126, 127):
                raise NoSupervisor("the sandbox image has no python3 to run the command supervisor") from None
            raise SupervisorDown(f"the command supervisor did not start (exit {code})") from None
        with contextlib.suppress(Exception):
            link.host_pid = int((await api.exec_inspect(exec_id)).get("Pid") or 0)
            link.high = namespace_pid(link.host_pid)
        return link

    # -- sending ---------------------------------------------------------------
    def send_nowait(self, kind: bytes, cid: int, payload: bytes = b"") -> None:
        if not self.alive:
            return
        try:
            self.stream.writer.write(HDR.pack(kind[0], cid, len(payload)) + payload)
        except (ConnectionError, OSError, RuntimeError):
            self._die("its stream closed")

    async def send(self, kind: bytes, cid: int, payload: bytes = b"") -> None:
        if not self.alive:
            raise SupervisorDown(self.why)
        self.send_nowait(kind, cid, payload)
        try:
            await self.stream.writer.drain()
        except (ConnectionError, OSError):
            self._die("its stream closed")

    def credit(self, cmd: SupervisedCommand, n: int) -> None:
        if n and not cmd.done:
            cmd.allowed += n
            self.send_nowait(b"C", cmd.cid, CODE.pack(n))

    async def open(self, argv: list[str], cwd: str, env: list[str], stdin: bool) -> SupervisedCommand:
        if not self.alive:
            raise SupervisorDown(self.why)
        cid = self._next
        self._next += 1
        cmd = SupervisedCommand(self, cid)
        self.cmds[cid] = cmd
        await self.send(b"S", cid, json.dumps({"argv": argv, "cwd": cwd, "env": env, "stdin": stdin}).encode())
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await asyncio.shield(cmd.started)
        except TimeoutError:
            self._die("it did not answer")
        return cmd

    # -- receiving ---------------------------------------------------------------
    async def _read(self) -> None:
        why = "its stream closed"
        try:
            while self.alive:
                frame = await self.stream.frame()
                if frame is None:
                    break
                kind, data = frame
                if kind == STDERR:
                    self._stderr = (self._stderr + data)[-2000:]
                    continue
                if kind != STDOUT:
                    continue
                self._buf += data
                bad = self._parse()
                if bad:
                    why = bad
                    break
        except (ConnectionError, OSError) as exc:
            why = f"its stream failed: {exc.__class__.__name__}"
        except asyncio.CancelledError:
            why = CLOSED
        self._die(why)

    def _parse(self) -> str:
        while len(self._buf) >= HDR.size:
            kind, cid, n = HDR.unpack_from(self._buf)
            if n > MAX_PAYLOAD:
                return "it sent a malformed frame"
            if len(self._buf) < HDR.size + n:
                return ""
            payload = bytes(self._buf[HDR.size:HDR.size + n])
            del self._buf[:HDR.size + n]
            k = chr(kind)
            if k == "H":
                if not self._hello.done():
                    self._hello.set_result(None)
                continue
            cmd = self.cmds.get(cid)
            if cmd is None or cmd.done or not self._hello.done():
                return "it spoke of a command it was not given"
            if k == "P" and n == CODE.size:
                cmd._started(CODE.unpack(payload)[0])
                self.high = max(self.high, cmd.pid)
            elif k in "OR" and len(k) == 1:
                if not cmd._output(STDOUT if k == "O" else STDERR, payload):
                    return "it sent more output than it was allowed"
            elif k == "W" and n == CODE.size:
                if not cmd._taken(CODE.unpack(payload)[0]):
                    return "it acknowledged stdin it was not sent"
            elif k == "X" and n == CODE.size:
                cmd._exit(CODE.unpack(payload)[0])
                del self.cmds[cid]
            else:
                return "it sent a malformed frame"
        return ""

    def _die(self, why: str) -> None:
        if not self.alive:
            return
        self.alive = False
        self.why = why
        if not self._hello.done():
            self._hello.set_exception(SupervisorDown(why))
            self._hello.exception()     # retrieved: no "never retrieved" warning
        running = [c for c in self.cmds.values() if not c.done and c.pid > 0]
        # started, but the supervisor died before saying so: its pid is unknown
        unknown = [c for c in self.cmds.values() if not c.done and c.pid <= 0] if why != CLOSED else []
        for c in list(self.cmds.values()):
            if c not in running and c not in unknown:
                c._fail(why)
        self.cmds.clear()
        self.stream.close()
        if self._stderr:
            log.info("command supervisor of %s: %s", self.container_id[:12],
                     self._stderr.decode("utf-8", "replace")[-500:])
        (log.debug if why == CLOSED else log.warning)(
            "command supervisor of sandbox %s stopped: %s", self.container_id[:12], why)
        if running or unknown:
            # their parent is gone: kill the process groups from inside, as the sandbox user,
            # and only then tell their callers (so "the command was killed" is true)
            asyncio.get_running_loop().create_task(self._kill_orphans(running, unknown, why))

    async def _kill_orphans(self, cmds: list[SupervisedCommand], unknown: list[SupervisedCommand],
                            why: str) -> None:
        try:
            if cmds:
                await self._kill_inside([c.pid for c in cmds])
            if unknown:
                await self._run_inside(["python3", "-c", SWEEP, str(self.high)])
        finally:
            for c in cmds + unknown:
                c._fail(why)

    async def _kill_inside(self, pids: list[int]) -> None:
        await self._run_inside(["kill", "-KILL", "--", *(f"-{p}" for p in pids)])

    async def _run_inside(self, argv: list[str]) -> None:
        with contextlib.suppress(Exception):
            kid = await self.api.exec_create(self.container_id, argv, workdir="/", env=[], stdin=False)
            s = await self.api.exec_start(kid, container=self.container_id)
            while await s.frame() is not None:
                pass
            s.close()

    async def kill(self, cmd: SupervisedCommand) -> None:
        """SIGKILL the command's process group: from the host where the broker
        may (it does not depend on the supervisor), else by the supervisor."""
        if cmd.done or cmd.pid <= 0:
            return
        host = await asyncio.to_thread(host_pid_of, self.host_pid, cmd.pid) if self.host_pid else 0
        if host:
            try:
                os.killpg(host, signal.SIGKILL)
                return
            except ProcessLookupError:
                return
            except PermissionError:
                pass
        if self.alive:
            await self.send(b"K", cmd.cid)
        else:
            await self._kill_inside([cmd.pid])

    def close(self) -> None:
        self._die(CLOSED)
        if self._reader is not None:
            self._reader.cancel()


class Supervisors:
    """One link per sandbox container, started on first use (or ahead with
    `warm`), restarted when it dies, given up for exec after MAX_RESTARTS."""

    def __init__(self, api: DockerAPI, enabled: bool = True) -> None:
        self.api = api
        self.enabled = enabled
        self._links: dict[str, Link] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._restarts: dict[str, int] = {}
        self._exec_only: set[str] = set()

    async def link(self, container_id: str) -> Link | None:
        """The live link of a container, or None: use one exec per command.
        Engine errors (NotFound, 409 not running) propagate to the caller."""
        if not self.enabled or container_id in self._exec_only:
            return None
        link = self._links.get(container_id)
        if link is not None and link.alive:
            return link
        async with self._locks.setdefault(container_id, asyncio.Lock()):
            link = self._links.get(container_id)
            if link is not None and link.alive:
                return link
            if link is not None:
                n = self._restarts[container_id] = self._restarts.get(container_id, 0) + 1
                if n > MAX_RESTARTS:
                    log.warning("sandbox %s: its command supervisor stopped %d times; one exec per command "
                                "from now on", container_id[:12], n)
                    self._exec_only.add(container_id)
                    self._links.pop(container_id, None)
                    return None
            try:
                link = await Link.start(self.api, container_id)
            except NoSupervisor:
                self._exec_only.add(container_id)
                return None
            except SupervisorDown as exc:
                log.warning("sandbox %s: %s; using one exec per command", container_id[:12], exc)
                return None
            self._links[container_id] = link
            return link

    async def warm(self, container_id: str) -> None:
        """Start the supervisor ahead of the first command (errors are the first
        command's to report)."""
        with contextlib.suppress(Exception):
            await self.link(container_id)

    def drop(self, container_id: str) -> None:
        link = self._links.pop(container_id, None)
        self._locks.pop(container_id, None)
        self._restarts.pop(container_id, None)
        self._exec_only.discard(container_id)
        if link is not None:
            link.close()

    def live(self) -> list[Link]:
        return [lk for lk in self._links.values() if lk.alive]


__all__ = ["IN_WINDOW", "MARKER", "MAX_SEND", "STOPPED", "WINDOW", "EngineError", "Link", "NoSupervisor",
           "SupervisedCommand", "SupervisorDown", "Supervisors"]
