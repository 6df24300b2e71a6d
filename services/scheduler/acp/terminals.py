"""ACP terminals, run inside the ticket's sandbox (R4).

`terminal/create` starts the command through the sandbox broker's
interactive `Process`, inside the sandbox: with `args`, `[command, *args]`
is the argv (no shell); with no `args` (absent or empty), `command` is a
shell line, as agents send it (Claude Code: `{"command": "python3 -m
unittest -q"}`) and editors run it, so the argv is `/bin/sh -c COMMAND`.
The cwd is mapped under /workspace; no environment secret: `env_names` is
empty, and the agent's own `env` entries are passed with `env NAME=VALUE`,
values the agent already had. Output is kept up to the terminal's byte limit (the
oldest bytes are dropped, as ACP asks), `kill` and `release` send the
broker a kill, and every terminal still running when the node ends is
killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from services._gen.afe.sandbox.v1 import sandbox_pb2
from services.common.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from services.common.rpc.grpcutil import rpc_errors

from .paths import workspace_cwd

log = logging.getLogger(__name__)

DEFAULT_OUTPUT_LIMIT = 1024 * 1024
MAX_OUTPUT_LIMIT = 4 * 1024 * 1024
MAX_TERMINALS = 8
MAX_ARGS = 1024
MAX_ARGV_BYTES = 128 * 1024
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
SHELL = "/bin/sh"


def terminal_argv(command: str, args: list[str] | None) -> list[str]:
    """The argv for a terminal: `[command, *args]`, or a shell line run by /bin/sh."""
    if args:
        return [command, *args]
    return [SHELL, "-c", command]


@dataclass
class Terminal:
    id: str
    argv: list[str]
    limit: int
    output: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    exit: sandbox_pb2.ExecExit | None = None
    killed: bool = False
    error: str = ""
    inputs: asyncio.Queue[sandbox_pb2.ProcessInput | None] = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    call: Any = None

    def append(self, data: bytes) -> None:
        self.output += data
        if len(self.output) > self.limit:
            del self.output[: len(self.output) - self.limit]
            self.truncated = True

    def text(self) -> str:
        # Dropping the oldest bytes may split a character: decode leniently.
        return self.output.decode("utf-8", "replace")

    def exit_status(self) -> dict[str, Any] | None:
        if not self.done.is_set():
            return None
        code = self.exit.code if self.exit is not None else -1
        if self.killed or code < 0:
            return {"exit_code": None, "signal": "SIGKILL"}
        return {"exit_code": code, "signal": None}


class Terminals:
    def __init__(self, sandbox: Any, ticket_id: str, *, max_terminals: int = MAX_TERMINALS) -> None:
        self._sandbox = sandbox
        self._ticket = ticket_id
        self._max = max_terminals
        self._terms: dict[str, Terminal] = {}
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()

    def get(self, terminal_id: str) -> Terminal:
        term = self._terms.get(terminal_id)
        if term is None:
            raise NotFound(f"no terminal {terminal_id[:64]!r}")
        return term

    async def create(self, command: str, args: list[str] | None, env: list[Any] | None,
                     cwd: str | None, output_byte_limit: int | None) -> Terminal:
        running = sum(1 for t in self._terms.values() if not t.done.is_set())
        if running >= self._max:
            raise ResourceExhausted(f"at most {self._max} terminals may run at once; release one first")
        if not command:
            raise InvalidArgument("terminal command must not be empty")
        argv = terminal_argv(command, args)
        if len(argv) > MAX_ARGS or sum(len(a) for a in argv) > MAX_ARGV_BYTES:
            raise InvalidArgument("terminal command line is too long")
        if env:
            assigns = []
            for var in env:
                if not ENV_NAME.match(var.name or ""):
                    raise InvalidArgument(f"invalid environment variable name {str(var.name)[:64]!r}")
                assigns.append(f"{var.name}={var.value}")
            argv = ["env", *assigns, *argv]
        rel_cwd = workspace_cwd(cwd)
        limit = DEFAULT_OUTPUT_LIMIT if not output_byte_limit else min(int(output_byte_limit), MAX_OUTPUT_LIMIT)
        term = Terminal(id=f"term-{next(self._ids)}", argv=argv, limit=max(limit, 0))
        start = sandbox_pb2.ProcessStart(ticket_id=self._ticket, argv=argv, cwd=rel_cwd, env_names=[])
        term.inputs.put_nowait(sandbox_pb2.ProcessInput(start=start))
        term.inputs.put_nowait(sandbox_pb2.ProcessInput(close_stdin=True))
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        term.task = asyncio.create_task(self._run(term, started), name=f"acp.{term.id}")
        self._terms[term.id] = term
        self._tasks.add(term.task)
        term.task.add_done_callback(self._tasks.discard)
        try:
            await started
        except BaseException:
            self._terms.pop(term.id, None)
            raise
        return term

    async def _requests(self, term: Terminal) -> AsyncIterator[sandbox_pb2.ProcessInput]:
        while True:
            item = await term.inputs.get()
            if item is None:
                return
            yield item

    async def _run(self, term: Terminal, started: asyncio.Future[None]) -> None:
        try:
            async with rpc_errors():
                term.call = self._sandbox.Process(self._requests(term))
                async for out in term.call:
                    kind = out.WhichOneof("output")
                    if kind == "started" and not started.done():
                        started.set_result(None)
                    elif kind in ("stdout", "stderr"):
                        if not started.done():
                            started.set_result(None)
                        if term.id in self._terms:          # released terminals keep nothing
                            term.append(out.stdout if kind == "stdout" else out.stderr)
                    elif kind == "exit":
                        term.exit = out.exit
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any broker failure ends this terminal only
            term.error = str(exc)
            if not started.done():
                started.set_exception(exc if isinstance(exc, Exception) else Unavailable(str(exc)))
        finally:
            if not started.done():
                started.set_result(None)
            term.inputs.put_nowait(None)
            term.done.set()

    async def wait(self, terminal_id: str) -> Terminal:
        term = self.get(terminal_id)
        await term.done.wait()
        return term

    def kill(self, terminal_id: str) -> Terminal:
        term = self.get(terminal_id)
        self._kill(term)
        return term

    def _kill(self, term: Terminal) -> None:
        if not term.done.is_set() and not term.killed:
            term.killed = True
            term.inputs.put_nowait(sandbox_pb2.ProcessInput(kill=True))

    def release(self, terminal_id: str) -> None:
        term = self.get(terminal_id)
        self._kill(term)
        del self._terms[terminal_id]
        term.output = bytearray()
        # The run task ends on its own once the broker reports the exit.

    async def close(self, timeout: float = 5.0) -> None:
        """Kill every terminal and wait (bounded) for them to end."""
        for term in self._terms.values():
            self._kill(term)
        self._terms.clear()
        tasks = [t for t in self._tasks if not t.done()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
