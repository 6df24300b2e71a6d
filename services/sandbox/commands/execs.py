"""Running commands in a ticket's sandbox: `run_exec` (streamed output,
exit code, timeout that kills, output cap with a marker) and `Process`
(an interactive byte stream with stdin, clean EOF and kill).

Both go through the sandbox's command supervisor (command_supervisor.py: one
process per sandbox fed over an attached stream) or, when a sandbox has
none, one Docker exec each over a hijacked engine connection; argv is passed
as-is (no shell). The working directory is confined to /workspace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from services.common.errors import AfeError, FailedPrecondition, InvalidArgument, NotFound
from services.sandbox.commands.command_supervisor import SupervisedCommand, SupervisorDown, Supervisors
from services.sandbox.containers import deaths
from services.sandbox.containers.deaths import DeathWatch
from services.sandbox.containers.dockerapi import STDERR, STDOUT, DockerAPI, EngineError, ExecStream
from services.sandbox.containers.hardening import WORKSPACE
from services.sandbox.containers.info import SandboxInfo
from services.sandbox.containers.nspids import namespace_pid
from services.sandbox.files.paths import split_relative
from services.sandbox.sandboxes import SandboxManager

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_MS = 10 * 60 * 1000
MAX_TIMEOUT_MS = 6 * 60 * 60 * 1000
DEFAULT_OUTPUT_CAP = 4 * 1024 * 1024
MAX_OUTPUT_CAP = 64 * 1024 * 1024
MAX_CHUNK = 64 * 1024
MAX_ARGV_BYTES = 256 * 1024


@dataclass(frozen=True)
class Output:
    stream: str          # "stdout" | "stderr"
    data: bytes


@dataclass(frozen=True)
class Exit:
    code: int
    timed_out: bool = False
    truncated: bool = False
    duration_ms: int = 0


def workdir(cwd: str) -> str:
    if cwd in ("", "."):
        return WORKSPACE
    return WORKSPACE + "/" + "/".join(split_relative(cwd))


# A gVisor exec starts by saying its pid in gVisor's kernel (InnerPidExec).
PID_WORD = b"afe-exec-pid"
SAY_PID = ["/bin/sh", "-c", f'echo "{PID_WORD.decode()} $$"; exec "$@"', "sh"]
# What runsc writes on an exec's stderr when its sandbox's kernel is gone under it
# (the stream then stays open, or ends with 128 a moment before the engine sees
# the container stop): the broker says why instead (deaths.py).
RUNSC_LOST = re.compile(rb'waiting on pid \d+: waiting on PID \d+ in sandbox "[0-9a-f]+": '
                        rb'urpc method "containerManager\.WaitPID" failed: EOF\n?')
# How long the engine may take to see a gVisor sandbox stop after runsc said so
# (measured about 1 s under load).
RUNSC_LOST_GRACE_S = 5.0


def check_argv(argv: list[str]) -> list[str]:
    if not argv or not argv[0]:
        raise InvalidArgument("argv must name a program (use [\"bash\", \"-lc\", CMD] for a shell)")
    if any("\x00" in a for a in argv) or sum(len(a) for a in argv) > MAX_ARGV_BYTES:
        raise InvalidArgument("argv must not contain NUL bytes and must be under 256 KiB")
    return list(argv)


def truncation_marker(cap: int) -> bytes:
    return f"\n[afe: output truncated after {cap} bytes]\n".encode()


class _Exec:
    """One `docker exec`: the same face as a supervised command (frame, write,
    close_stdin, close, kill, exit_code), used when a sandbox has no
    supervisor (an image without python3, or one whose supervisor keeps
    dying)."""

    def __init__(self, runner: Runner, exec_id: str, stream: ExecStream) -> None:
        self.runner = runner
        self.exec_id = exec_id
        self.stream = stream

    async def frame(self) -> tuple[int, bytes] | None:
        return await self.stream.frame()

    async def write(self, data: bytes) -> None:
        await self.stream.write(data)

    def close_stdin(self) -> None:
        self.stream.close_stdin()

    def close(self) -> None:
        self.stream.close()

    def abort(self) -> None:
        """Its sandbox stopped: end the output now (the engine may keep the stream open)."""
        self.stream.abort()

    async def kill(self) -> None:
        await self.runner.kill(self.exec_id)

    async def exit_code(self) -> int:
        return await self.runner.api.exit_code(self.exec_id)


class InnerPidExec(_Exec):
    """A `docker exec` in a gVisor sandbox. The engine's pid of such an exec
    is the host's `runsc exec`, not the command, which lives in gVisor's
    kernel: killing that pid's group leaves the command running. So the
    command is started by `SAY_PID` (its first stdout line is its own pid,
    taken off the output here; every exec is a session leader there) and is
    killed from inside, by its process group."""

    def __init__(self, runner: Runner, exec_id: str, stream: ExecStream, container_id: str) -> None:
        super().__init__(runner, exec_id, stream)
        self.container_id = container_id
        self.pid = 0                  # >0 once said, -1 when it never was
        self._head = b""              # stdout before the pid line ended
        self._said = asyncio.Event()
        self._next: list[tuple[int, bytes] | None] = []
        self.runsc_lost = b""         # runsc's last words, held back (`Runner._sandbox_lost`)

    async def frame(self) -> tuple[int, bytes] | None:
        """The next frame; runsc's word that the sandbox is gone, when it is
        the last, is held back in `runsc_lost` for the runner to weigh."""
        if self._next:
            return self._next.pop(0)
        frame = await self._frame()
        if frame is not None and frame[0] == STDERR and RUNSC_LOST.fullmatch(frame[1]):
            following = await self._frame()
            if following is None:
                self.runsc_lost = frame[1]
                return None
            self._next.append(following)
        return frame

    async def _frame(self) -> tuple[int, bytes] | None:
        while True:
            frame = await self.stream.frame()
            if frame is None or self.pid or frame[0] != STDOUT:
                if frame is None:
                    self._said.set()
                return frame
            self._head += frame[1]
            line, sep, rest = self._head.partition(b"\n")
            if not sep:
                if len(self._head) > 64:          # not our line: pass it on as it came
                    self.pid, data, self._head = -1, self._head, b""
                    return STDOUT, data
                continue
            self._head = b""
            word, _, number = line.partition(b" ")
            self.pid = int(number) if word == PID_WORD and number.isdigit() else -1
            self._said.set()
            if self.pid < 0:
                rest = line + sep + rest
            if rest:
                return STDOUT, rest

    async def kill(self) -> None:
        if not self.pid:              # started a moment ago: its pid line is on its way
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    await self._said.wait()
        if self.pid > 0:
            await self.runner.kill_inside(self.container_id, self.pid)
        else:
            await super().kill()


Handle = _Exec | SupervisedCommand


class Runner:
    """Commands and processes in a ticket's sandbox: through the sandbox's
    command supervisor (command_supervisor.py) when it has one, else one `docker
    exec` each; the caller sees no difference but the speed."""

    def __init__(self, sandboxes: SandboxManager, api: DockerAPI | None = None, *, supervise: bool = True,
                 death_watch: DeathWatch | None = None) -> None:
        self.sandboxes = sandboxes
        self.api = api or DockerAPI()
        self.supervisors = Supervisors(self.api, enabled=supervise)
        self.death_watch = death_watch or DeathWatch(self.api)
        self._containers: dict[str, str] = {}     # ticket -> container whose supervisor we hold

    async def _open(self, ticket_id: str, argv: list[str], cwd: str, env: list[str],
                    stdin: bool) -> tuple[Handle, SandboxInfo]:
        info = await self.sandboxes.get(ticket_id)
        argv, wd = check_argv(argv), workdir(cwd)
        if info.state == "paused":
            raise FailedPrecondition(f"the sandbox of {ticket_id} is not running (frozen or stopped)")
        try:
            # gVisor lets a process open a non-dumpable process's /proc/PID/fd (runc refuses), so the
            # supervisor's private stream would be open to the sandbox there (R4): one exec per command.
            link = None if info.runtime == "gvisor" else await self.supervisors.link(info.container_id)
            if link is not None:
                self._containers[ticket_id] = info.container_id
                try:
                    return await link.open(argv, wd, env, stdin), info
                except SupervisorDown:
                    pass                  # it stopped before the command started: one exec instead
            if info.runtime == "gvisor":
                exec_id = await self.api.exec_create(info.container_id, [*SAY_PID, *argv], workdir=wd, env=env,
                                                     stdin=stdin)
                stream = await self.api.exec_start(exec_id, container=info.container_id)
                return InnerPidExec(self, exec_id, stream, info.container_id), info
            exec_id = await self.api.exec_create(info.container_id, argv, workdir=wd, env=env, stdin=stdin)
            return _Exec(self, exec_id, await self.api.exec_start(exec_id, container=info.container_id)), info
        except NotFound:
            self.sandboxes.forget(ticket_id)
            raise NotFound(f"no sandbox for ticket {ticket_id}: create it first") from None
        except EngineError as exc:
            if exc.status == 409:
                why = await deaths.why_killed(self.api, info.container_id)
                raise FailedPrecondition(f"the sandbox of {ticket_id} is not running "
                                         + (f"({why})" if why else "(frozen or stopped)")) from exc
            raise

    async def warm(self, ticket_id: str) -> None:
        """Start the ticket's command supervisor ahead of its first command."""
        with contextlib.suppress(Exception):
            info = await self.sandboxes.get(ticket_id)
            if info.runtime == "gvisor":
                return
            self._containers[ticket_id] = info.container_id
            await self.supervisors.warm(info.container_id)

    async def warm_container(self, ticket_id: str, container_id: str) -> None:
        """`warm` for a sandbox being made (not yet known to `get`)."""
        self._containers[ticket_id] = container_id
        await self.supervisors.warm(container_id)

    def release(self, ticket_id: str) -> None:
        """The ticket's sandbox is gone (destroyed, reconciled): drop its link."""
        cid = self._containers.pop(ticket_id, None)
        if cid:
            self.supervisors.drop(cid)

    async def kill(self, exec_id: str) -> None:
        """SIGKILL the exec's process group (runc makes every exec a session leader)."""
        delay = 0.002
        for _ in range(200):
            try:
                doc = await self.api.exec_inspect(exec_id)
            except (AfeError, EngineError, OSError):
                return
            if doc.get("Running") and int(doc.get("Pid") or 0) > 0:
                break
            if doc.get("ExitCode") is not None:
                return          # already over
            await asyncio.sleep(delay)     # started a moment ago: not running yet
            delay = min(delay * 2, 0.05)
        else:
            return
        pid = int(doc["Pid"])
        try:
            os.killpg(pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        # Not allowed from the host: kill from inside, as the sandbox user.
        nspid = namespace_pid(pid)
        if nspid:
            with contextlib.suppress(Exception):
                kid = await self.api.exec_create(doc["ContainerID"], ["kill", "-KILL", "--", f"-{nspid}"],
                                                 workdir="/", env=[], stdin=False)
                s = await self.api.exec_start(kid, container=doc["ContainerID"])
                while await s.frame() is not None:
                    pass
                s.close()

    async def kill_inside(self, container_id: str, pid: int) -> None:
        """SIGKILL the process group `pid` of the sandbox, from inside, as the sandbox user."""
        with contextlib.suppress(Exception):
            kid = await self.api.exec_create(container_id, ["kill", "-KILL", "--", f"-{int(pid)}"],
                                             workdir="/", env=[], stdin=False)
            s = await self.api.exec_start(kid, container=container_id)
            while await s.frame() is not None:
                pass
            s.close()

    @contextlib.contextmanager
    def _watch(self, stream: Handle, info: SandboxInfo) -> Iterator[deaths.Watch | None]:
        """While an exec runs, its container's watch (deaths.py): if the
        sandbox stops, the exec's output ends at once. (A supervised command
        needs none: its supervisor's stream ends with the container.)"""
        if not isinstance(stream, _Exec):
            yield None
            return
        with self.death_watch.watching(info.container_id) as watch:
            def ended(w: deaths.Watch) -> None:
                if deaths.died(w):
                    stream.abort()
            watch.add_done_callback(ended)
            try:
                yield watch
            finally:
                watch.remove_done_callback(ended)

    @staticmethod
    async def _sandbox_lost(stream: Handle, watch: deaths.Watch | None) -> tuple[bool, bytes]:
        """Whether the sandbox stopped under the exec whose output just
        ended, and else what runsc said last (held back, to be passed on).
        When runsc says its sandbox is gone, the engine is given a moment to
        see the container stop."""
        if watch is None:
            return False, b""
        said = stream.runsc_lost if isinstance(stream, InnerPidExec) else b""
        if said and not watch.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(watch), RUNSC_LOST_GRACE_S)
        lost = deaths.died(watch)
        return lost, b"" if lost else said

    async def run_exec(self, ticket_id: str, argv: list[str], *, cwd: str = "", timeout_ms: int = 0,
                       output_cap: int = 0, stdin: bytes = b"") -> AsyncIterator[Output | Exit]:
        if timeout_ms < 0 or output_cap < 0:
            raise InvalidArgument("timeout_ms and output_cap_bytes must be >= 0 (0 = default)")
        timeout = min(timeout_ms or DEFAULT_TIMEOUT_MS, MAX_TIMEOUT_MS) / 1000
        cap = min(output_cap or DEFAULT_OUTPUT_CAP, MAX_OUTPUT_CAP)
        t0, began = time.monotonic(), time.time()
        stream, info = await self._open(ticket_id, argv, cwd, [], stdin=bool(stdin))
        sent = 0
        truncated = False
        timed_out = False
        lost = False
        writer_task = None
        if stdin:
            writer_task = asyncio.create_task(_feed(stream, stdin))
        # One deadline for the whole command (asyncio.timeout, not a wait_for per
        # frame: that made a task for every frame).
        deadline = asyncio.get_running_loop().time() + max(0.0, t0 + timeout - time.monotonic())
        with self._watch(stream, info) as watch:
            try:
                while True:
                    try:
                        async with asyncio.timeout_at(deadline):
                            frame = await stream.frame()
                    except TimeoutError:
                        timed_out = True
                        break
                    if frame is None:
                        break
                    kind, data = frame
                    if kind not in (STDOUT, STDERR) or truncated:
                        continue
                    if sent + len(data) > cap:
                        data = data[:cap - sent]
                        truncated = True
                    sent += len(data)
                    name = "stdout" if kind == STDOUT else "stderr"
                    for i in range(0, len(data), MAX_CHUNK):
                        yield Output(name, data[i:i + MAX_CHUNK])
                    if truncated:
                        yield Output("stderr", truncation_marker(cap))
                lost, said = await self._sandbox_lost(stream, watch)
                if said:
                    yield Output("stderr", said)
                if timed_out:
                    await stream.kill()
                    code = -1
                else:
                    code = deaths.KILLED if lost else await _exit_code(stream)
            except BaseException:
                # The caller went away (cancelled): never leave the process behind.
                with contextlib.suppress(BaseException):
                    await asyncio.shield(stream.kill())
                raise
            finally:
                if writer_task:
                    writer_task.cancel()
                stream.close()
        reason = self.sandboxes.disk_exceeded(ticket_id)
        if not reason and not timed_out and code == deaths.KILLED:
            # killed with its sandbox, or by the kernel at the sandbox's memory limit: say which limit
            reason = await deaths.why_killed(self.api, info.container_id, since=began)
        if reason:
            yield Output("stderr", f"\n{reason}\n".encode())
        yield Exit(code=code, timed_out=timed_out, truncated=truncated,
                   duration_ms=int((time.monotonic() - t0) * 1000))

    async def start_process(self, ticket_id: str, argv: list[str], *, cwd: str = "",
                            env_names: list[str] | tuple[str, ...] = (),
                            env: list[str] | tuple[str, ...] = ()) -> Process:
        info = await self.sandboxes.get(ticket_id)
        literal = self.sandboxes.literal_env_for(info, env)
        env = literal + self.sandboxes.env_for(info, env_names)
        stream, info = await self._open(ticket_id, argv, cwd, env, stdin=True)
        return Process(stream, self, info)


async def _exit_code(stream: Handle) -> int:
    """The command's exit code; `KILLED` when its exec went with its container."""
    try:
        return await stream.exit_code()
    except NotFound:
        return deaths.KILLED


async def _feed(stream: Handle, data: bytes) -> None:
    try:
        await stream.write(data)
    except (ConnectionError, OSError):
        pass
    finally:
        stream.close_stdin()


class Process:
    """An interactive process: write stdin, close stdin (EOF), kill, and read
    output until the Exit."""

    def __init__(self, stream: Handle, runner: Runner, info: SandboxInfo) -> None:
        self.stream = stream
        self.runner = runner
        self.info = info
        self.t0 = time.monotonic()
        self.began = time.time()
        self.killed = False
        self._stdin_closed = False

    async def write(self, data: bytes) -> None:
        if self._stdin_closed:
            raise InvalidArgument("stdin is already closed")
        with contextlib.suppress(ConnectionError, OSError, SupervisorDown):
            await self.stream.write(data)

    def close_stdin(self) -> None:
        self._stdin_closed = True
        self.stream.close_stdin()

    async def kill(self) -> None:
        self.killed = True
        await self.stream.kill()

    async def output(self) -> AsyncIterator[Output | Exit]:
        with self.runner._watch(self.stream, self.info) as watch:
            try:
                while True:
                    frame = await self.stream.frame()
                    if frame is None:
                        break
                    kind, data = frame
                    if kind not in (STDOUT, STDERR):
                        continue
                    name = "stdout" if kind == STDOUT else "stderr"
                    for i in range(0, len(data), MAX_CHUNK):
                        yield Output(name, data[i:i + MAX_CHUNK])
                lost, said = await self.runner._sandbox_lost(self.stream, watch)
                if said:
                    yield Output("stderr", said)
                code = deaths.KILLED if lost else await _exit_code(self.stream)
            except BaseException:
                with contextlib.suppress(BaseException):
                    await asyncio.shield(self.stream.kill())
                raise
            finally:
                self.stream.close()
        if code == deaths.KILLED and not self.killed:
            reason = await deaths.why_killed(self.runner.api, self.info.container_id, since=self.began)
            if reason:
                yield Output("stderr", f"\n{reason}\n".encode())
        yield Exit(code=code, duration_ms=int((time.monotonic() - self.t0) * 1000))
