"""`closed_with_call` (services/common/rpc/streamdrop.py): a server stream's
generator is closed when its call ends, also when it is suspended at a
`yield` (grpc.aio's cancellation reaches only a handler awaiting inside),
so its `finally` — kill the command, remove the private copy — runs then,
not whenever the garbage collector finds it."""

from __future__ import annotations

import asyncio
import gc

from services.common.rpc.streamdrop import closed_with_call


class Call:
    """The part of a grpc.aio servicer context `closed_with_call` uses."""

    def __init__(self) -> None:
        self.callbacks: list = []

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def end(self) -> None:
        for cb in self.callbacks:
            cb(self)


async def _turns(n: int = 10) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_stream_suspended_at_a_yield_is_closed_when_its_call_ends():
    closed: list[str] = []

    async def handler(name: str):
        try:
            yield 1
            yield 2
        finally:
            closed.append(name)

    gc.disable()      # nothing but the close itself may finalize the generators below
    try:
        call = Call()
        stream = closed_with_call(call, handler("closed"))
        assert await stream.__anext__() == 1     # suspended at its yield, as while grpc writes the item
        call.end()
        await _turns()
        assert closed == ["closed"]
        # positive control: the same handler without it stays open when its call ends
        bare = handler("bare")
        assert await bare.__anext__() == 1
        Call().end()
        await _turns()
        assert closed == ["closed"]
        await bare.aclose()
        assert closed == ["closed", "bare"]
    finally:
        gc.enable()


async def test_a_stream_awaiting_inside_is_left_to_the_cancellation():
    """One awaiting inside cannot be closed (aclose raises while it runs);
    cancelling the task that drives it reaches its `finally` there."""
    closed: list[str] = []
    gate = asyncio.Event()

    async def handler():
        try:
            await gate.wait()
            yield 1
        finally:
            closed.append("cancelled")

    call = Call()
    stream = closed_with_call(call, handler())
    driver = asyncio.ensure_future(stream.__anext__())
    await _turns()
    call.end()                  # no error from trying to close a running generator
    await _turns()
    assert closed == []
    driver.cancel()
    await _turns()
    assert closed == ["cancelled"] and driver.cancelled()
