"""Dropping a caller that stopped reading a server stream (`send_within`):
the call ends with RESOURCE_EXHAUSTED without waiting for that caller, and
`StreamDropped` ends the handler.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

import grpc

from services.common import errors
from services.common.rpc.statuses import ORIGIN

log = logging.getLogger(__name__)


class StreamDropped(errors.ResourceExhausted):
    """A server stream that `send_within` ended: its RESOURCE_EXHAUSTED status
    is already on its way, so the guard ends the handler without another one."""


# Called (by the metrics interceptor, per call) when send_within drops a stream.
on_drop: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("afe_on_drop", default=None)
# The status sends of dropped streams: they finish when the caller reads up to
# them or its connection closes (referenced here so they are not collected).
_dropping: set[asyncio.Future[Any]] = set()


def _dropped_status_done(task: asyncio.Future[Any]) -> None:
    _dropping.discard(task)
    if not task.cancelled():
        task.exception()  # AbortError once delivered, ExecuteBatchError if the caller went away first


async def send_within(context: grpc.aio.ServicerContext, message: Any, timeout: float, resume_hint: str) -> None:
    """Write one message of a server stream, or drop a caller that has
    stopped reading: when the transport has not taken the message within
    `timeout` seconds (its flow-control window to the caller stayed full, so
    the caller consumed nothing in that time), the call ends with
    RESOURCE_EXHAUSTED and `StreamDropped` is raised to end the handler.

    grpc.aio cannot cancel a send the transport already holds, and waiting
    for the status would wait for the caller (the status is queued behind
    the data it has not read; `context.abort` blocks until then). So the
    status is handed to the transport without waiting for it: the handler
    and whatever it holds (the watch's subscription) end at once, and the
    caller gets what the transport already held for it, then the status.
    The transport's share is bounded by the caller's flow-control window and
    is released when the caller reads it or closes its connection.
    """
    try:
        async with asyncio.timeout(timeout):     # no task per message, as wait_for would make
            await context.write(message)
        return
    except TimeoutError:
        pass
    text = (f"the stream was dropped: the caller took in nothing for {timeout:g} s (it stopped reading or "
            f"reads far slower than the stream is written); {resume_hint}")
    status = asyncio.ensure_future(context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, text, ORIGIN))
    _dropping.add(status)
    status.add_done_callback(_dropped_status_done)
    # One turn of the loop runs `abort` up to its wait for the caller: the code is set and the
    # status is queued in the transport (tasks start in the order they were scheduled).
    await asyncio.sleep(0)
    count = on_drop.get()
    if count is not None:
        count()
    log.info("a server stream was dropped: its caller took in nothing for %g s", timeout)
    raise StreamDropped(text)


# The closes `closed_with_call` started (referenced here until they finish).
_closing: set[asyncio.Future[Any]] = set()
Stream = TypeVar("Stream", bound=AsyncGenerator[Any, None])


def closed_with_call(context: grpc.aio.ServicerContext, stream: Stream) -> Stream:
    """`stream` (a server stream's async generator), closed as soon as its call
    ends: finished, cancelled, or its caller gone.

    grpc.aio ends a cancelled call by cancelling the task that drives the
    handler, and that reaches the handler's own code only while it awaits
    something inside it. A handler suspended at a `yield` (its last item still
    being written) would run its `finally` — kill its command, remove its
    private copy — only when the garbage collector finds it. So when the call
    is done and the generator is not running, it is closed here."""
    loop = asyncio.get_running_loop()

    def close() -> None:
        if getattr(stream, "ag_running", False):      # awaiting inside: the cancellation reaches it there
            return
        task = loop.create_task(stream.aclose())
        _closing.add(task)
        task.add_done_callback(_closing.discard)

    context.add_done_callback(lambda _ctx: loop.call_soon_threadsafe(close))
    return stream
