"""One command run by a sandbox's command supervisor (command_supervisor.py), seen
from the broker: the same face as an exec stream, with the output credit and
the stdin window that bound what either side buffers for it."""

from __future__ import annotations

import asyncio
from typing import Protocol

from services.sandbox.containers.dockerapi import STDERR

WINDOW = 256 * 1024            # as in command_supervisor_main.py: output credit per command
IN_WINDOW = 256 * 1024         # as in command_supervisor_main.py: stdin sent but not yet taken, per command
MAX_SEND = 64 * 1024
STOPPED = "[afe: the sandbox's command supervisor stopped ({why}); the command was killed]\n"


class Link(Protocol):
    """What a command needs of its supervisor's link (supervisor.Link): frames
    out, output credit back, and the kill of its process group."""

    def send_nowait(self, kind: bytes, cid: int, payload: bytes = b"") -> None: ...

    async def send(self, kind: bytes, cid: int, payload: bytes = b"") -> None: ...

    def credit(self, cmd: SupervisedCommand, n: int) -> None: ...

    async def kill(self, cmd: SupervisedCommand) -> None: ...


class SupervisedCommand:
    """One command run by a supervisor; the same face as an exec stream
    (frame, write, close_stdin, close, kill, exit_code)."""

    def __init__(self, link: Link, cid: int) -> None:
        self.link = link
        self.cid = cid
        self.pid = 0                  # in the sandbox's pid namespace
        self.code: int | None = None
        self.received = 0             # output bytes received ...
        self.allowed = WINDOW         # ... and the credit given: never more (bounded buffering)
        self.queue: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue()
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.done = False
        self.abandoned = False
        self.stdin_sent = 0           # stdin bytes sent ...
        self.stdin_taken = 0          # ... and taken by the child (or dropped): at most IN_WINDOW apart
        self._room = asyncio.Event()
        self._room.set()
        self._writing = asyncio.Lock()

    # called by the link's reader
    def _started(self, pid: int) -> None:
        self.pid = pid
        if not self.started.done():
            self.started.set_result(None)

    def _output(self, kind: int, data: bytes) -> bool:
        self.received += len(data)
        if self.received > self.allowed:
            return False            # past the credit it was given: not the supervisor we started
        if self.abandoned:
            self.link.credit(self, len(data))
            return True
        self.queue.put_nowait((kind, data))
        return True

    def _taken(self, n: int) -> bool:
        if n < 0 or self.stdin_taken + n > self.stdin_sent:
            return False            # more than it was sent: not the supervisor we started
        self.stdin_taken += n
        self._room.set()
        return True

    def _exit(self, code: int) -> None:
        if self.done:
            return
        self.done = True
        self.code = code
        self._room.set()            # a writer waiting for stdin credit: the command is over
        if not self.started.done():
            self.started.set_result(None)
        self.queue.put_nowait(None)

    def _fail(self, why: str) -> None:
        if self.done:
            return
        self.queue.put_nowait((STDERR, STOPPED.format(why=why).encode()))
        self._exit(-1)

    # the stream face
    async def frame(self) -> tuple[int, bytes] | None:
        item = await self.queue.get()
        if item is None:
            self.queue.put_nowait(None)
            return None
        self.link.credit(self, len(item[1]))
        return item

    async def write(self, data: bytes) -> None:
        """Send stdin, at most IN_WINDOW bytes ahead of what the child has
        read: a child that stops reading makes this wait (backpressure, as on
        an exec's stream), it never piles up in the supervisor. Once the
        command is over the rest is dropped."""
        view = memoryview(data)
        async with self._writing:
            while view and not self.done:
                room = IN_WINDOW - (self.stdin_sent - self.stdin_taken)
                if room <= 0:
                    self._room.clear()
                    await self._room.wait()
                    continue
                n = min(room, MAX_SEND, len(view))
                self.stdin_sent += n
                await self.link.send(b"I", self.cid, bytes(view[:n]))
                view = view[n:]

    def close_stdin(self) -> None:
        self.link.send_nowait(b"E", self.cid)

    def close(self) -> None:
        """The caller is done reading: whatever still comes is drained and dropped."""
        self.abandoned = True
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item is None:
                self.queue.put_nowait(None)
                break
            self.link.credit(self, len(item[1]))

    async def kill(self) -> None:
        await self.link.kill(self)

    async def exit_code(self) -> int:
        return self.code if self.code is not None else -1
