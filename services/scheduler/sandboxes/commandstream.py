"""The scheduler's end of the sandbox broker's `Commands` stream
(services/sandbox/commands/stream.py): every command of every ticket on one broker
goes over one open stream instead of an `Exec` call each.

    async for ev in stream.run(exec_request):   # ExecEvents, the last one the exit
        ...

`run` sends the command under a new id and reads its events from a queue
the stream's one reader fills. A command whose caller stops reading early
(a node's timeout, a cancelled ticket) is cancelled on the broker, which
kills its process group. When the stream breaks (the broker restarted, the
connection closed) every command on it fails as its `Exec` call would have
(`PeerUnavailable`, or the status the broker set) and the next command opens
a new stream. A broker without `Commands` (UNIMPLEMENTED) is remembered and
`run` raises `Unsupported` before anything ran: the caller uses `Exec`.

A command's events wait in a queue of its own until its caller reads them:
at most what the command may print (its output cap) and its exit, as the
broker caps each command's output.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.common import errors
from services.common.observability import telemetry
from services.common.rpc.grpcutil import error_from_rpc

# Commands running at once on one stream; one past it waits here for a slot. The broker
# refuses a stream with more than its own MAX_LIVE (services/sandbox/commands/stream.py, larger:
# a cancelled command's slot is free here before the broker has seen the cancel).
MAX_LIVE = 256


class Unsupported(Exception):
    """The broker has no `Commands` call: use `Exec`."""


class _Broken:
    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class _Stream:
    """One open call and the queues of the commands running on it."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.queues: dict[int, asyncio.Queue[Any]] = {}
        self.broken: _Broken | None = None
        self.reader: asyncio.Task[None] | None = None


class CommandStream:
    def __init__(self, open_call: Callable[[], Any], peer: str) -> None:
        self._open_call = open_call
        self.peer = peer
        self.unsupported = False
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)
        self._write = asyncio.Lock()
        self._cancels: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(MAX_LIVE)

    def _current(self) -> _Stream:
        s = self._stream
        if s is None or s.broken is not None:
            s = self._stream = _Stream(self._open_call())
            s.reader = asyncio.get_running_loop().create_task(self._read(s))
        return s

    async def _read(self, s: _Stream) -> None:
        error: BaseException | None = None
        try:
            async for ev in s.call:
                q = s.queues.get(ev.id)
                if q is not None:
                    q.put_nowait(ev)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.unsupported = True
            error = exc
        except asyncio.CancelledError:
            error = None
        except Exception as exc:  # noqa: BLE001 - whatever broke the stream fails its commands
            error = exc
        finally:
            s.broken = _Broken(error)
            if self._stream is s:
                self._stream = None
            for q in s.queues.values():
                q.put_nowait(s.broken)

    def _failure(self, broken: _Broken) -> BaseException:
        exc = broken.error
        if self.unsupported:
            return Unsupported()
        if isinstance(exc, grpc.aio.AioRpcError):
            return error_from_rpc(exc, self.peer, "the command")
        return errors.PeerUnavailable(f"{self.peer} went away during the command (its command stream closed)")

    async def run(self, req: spb.ExecRequest) -> AsyncIterator[spb.ExecEvent]:
        if self.unsupported:
            raise Unsupported()
        async with self._slots, contextlib.aclosing(self._run(req)) as events:
            async for ev in events:
                yield ev

    async def _run(self, req: spb.ExecRequest) -> AsyncGenerator[spb.ExecEvent, None]:
        s = self._current()
        cid = next(self._ids)
        q: asyncio.Queue[Any] = asyncio.Queue()
        s.queues[cid] = q
        ended = False
        try:
            try:
                async with self._write:
                    await s.call.write(spb.CommandInput(id=cid, run=req,
                                                        traceparent=telemetry.current_traceparent() or ""))
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                ended = True
                if s.reader is not None:
                    await asyncio.wait([s.reader], timeout=5)   # the reader says why the stream broke
                raise self._failure(s.broken or _Broken(None)) from None
            while True:
                item = await q.get()
                if isinstance(item, _Broken):
                    ended = True
                    raise self._failure(item)
                if item.WhichOneof("event") == "error":
                    ended = True
                    raise errors.from_code(item.error.code, item.error.message)
                ended = item.exec.WhichOneof("event") == "exit"
                yield item.exec
                if ended:
                    return
        finally:
            s.queues.pop(cid, None)
            if not ended and s.broken is None:
                # the caller stopped reading (a timeout, a cancel): stop the command on the broker
                task = asyncio.get_running_loop().create_task(self._cancel(s, cid))
                self._cancels.add(task)
                task.add_done_callback(self._cancels.discard)

    async def _cancel(self, s: _Stream, cid: int) -> None:
        with contextlib.suppress(Exception):
            async with self._write:
                await s.call.write(spb.CommandInput(id=cid, cancel=True))

    def close(self) -> None:
        s, self._stream = self._stream, None
        if s is not None:
            s.call.cancel()
