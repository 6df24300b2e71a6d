"""The `Commands` call: many commands over one stream, each run exactly as
`Exec` runs it (`Runner.run_exec`: the same timeouts, output caps, exit
codes, environment and process-group kill).

A call per command costs about a millisecond more than a message on a
stream that is already open (the call's setup, metadata and interceptors on
both sides), which is most of what a `run: true` node costs beyond the
command itself. So the scheduler keeps one stream per broker and sends each
command on it under an id of its own choosing:

- `run` starts a command in its own task; its events go back tagged with its
  id, the last being its exit, or an error (code name and redacted text)
  where `Exec` would have ended with a status;
- `cancel` cancels that task, which kills the command's process group, as
  cancelling an `Exec` call does;
- the caller closing its side ends the stream once every command has ended;
  the caller cancelling the call (or going away) cancels them all.

Bounded: at most MAX_LIVE commands at once on a stream, and the events wait
in a queue of QUEUE entries for the stream's writer, so a caller that stops
reading holds back the commands' output (their supervisor stops on its
credit) instead of making the broker buffer it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.common.errors import AfeError, InvalidArgument
from services.common.observability import telemetry
from services.common.observability.logs import ticket_var
from services.common.rpc.statuses import status_for
from services.sandbox.commands.execs import Exit, Output, Runner

log = logging.getLogger(__name__)

MAX_LIVE = 1024  # commands running at once on one stream (the scheduler keeps to 256)
QUEUE = 64       # events waiting for the stream's writer
# A command's span, in the trace of the caller's `traceparent`: named as an Exec
# call's span is, since it is the same operation (the stream itself has none).
COMMAND_SPAN = "/afe.sandbox.v1.SandboxBroker/Exec"


def exit_pb(x: Exit) -> pb.ExecExit:
    return pb.ExecExit(code=x.code, timed_out=x.timed_out, truncated=x.truncated, duration_ms=x.duration_ms)


def exec_event(ev: Output | Exit) -> tuple[pb.ExecEvent, str]:
    """The ExecEvent of one runner event, and the command's outcome once it exits."""
    if isinstance(ev, Output):
        return (pb.ExecEvent(stdout=ev.data) if ev.stream == "stdout" else pb.ExecEvent(stderr=ev.data)), ""
    return pb.ExecEvent(exit=exit_pb(ev)), "timeout" if ev.timed_out else "ok"


class _End:
    """The stream's last entry: every command has ended (or `error` ends the call)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


async def serve(runner: Runner, inputs: AsyncIterator[pb.CommandInput], redact: Callable[[str], str],
                counted: Callable[[str], None]) -> AsyncGenerator[pb.CommandEvent, None]:
    """The events of the commands `inputs` asks for; `counted(outcome)` once per command."""
    events: asyncio.Queue[pb.CommandEvent | _End] = asyncio.Queue(QUEUE)
    live: dict[int, asyncio.Task[None]] = {}

    async def one(cid: int, req: pb.ExecRequest, traceparent: str) -> None:
        ticket_var.set(req.ticket_id or None)     # this task's log records name its ticket
        with (telemetry.span(COMMAND_SPAN, parent=traceparent) if traceparent
              else contextlib.nullcontext()):
            await run_one(cid, req)

    async def run_one(cid: int, req: pb.ExecRequest) -> None:
        outcome = "error"
        try:
            async for ev in runner.run_exec(req.ticket_id, list(req.argv), cwd=req.cwd, timeout_ms=req.timeout_ms,
                                            output_cap=req.output_cap_bytes, stdin=req.stdin):
                event, ended = exec_event(ev)
                outcome = ended or outcome
                await events.put(pb.CommandEvent(id=cid, exec=event))
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:  # as the guard does for a call: every error becomes a status
            code, msg = status_for(exc)
            if isinstance(exc, AfeError):
                log.info("command %d -> %s: %s", cid, code.name, redact(msg))
            else:
                log.error("command %d failed: %s", cid, redact(repr(exc)), exc_info=exc)
            await events.put(pb.CommandEvent(id=cid, error=pb.CommandError(code=code.name, message=redact(msg))))
        finally:
            live.pop(cid, None)
            counted(outcome)

    async def read() -> None:
        try:
            async for msg in inputs:
                which = msg.WhichOneof("input")
                if which == "run":
                    if msg.id in live:
                        raise InvalidArgument(f"command id {msg.id} is already running on this stream")
                    if len(live) >= MAX_LIVE:
                        raise InvalidArgument(f"at most {MAX_LIVE} commands may run at once on one stream")
                    live[msg.id] = asyncio.create_task(one(msg.id, msg.run, msg.traceparent))
                elif which == "cancel":
                    task = live.get(msg.id)
                    if task is not None:
                        task.cancel()
                else:
                    raise InvalidArgument("a CommandInput must hold `run` or `cancel`")
            while live:                      # the caller is done asking: let the commands end
                await asyncio.wait(list(live.values()))
            await events.put(_End())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - ends the call with this error's status
            await events.put(_End(exc))

    reader = asyncio.create_task(read())
    try:
        while True:
            item = await events.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item
    finally:
        reader.cancel()
        tasks = [reader, *live.values()]
        for t in tasks:
            t.cancel()
        # each command's process group is killed as its task unwinds (Runner.run_exec)
        await asyncio.gather(*tasks, return_exceptions=True)
