"""The scheduler's end of the Commands stream (services/scheduler/sandboxes/commandstream.py)
against small gRPC servers of the sandbox broker's contract (no Docker):
an error event becomes the AfeError of its code, a caller that stops
reading cancels its command, a broken stream fails the commands on it as
PeerUnavailable and the next command opens a new one, and a broker without
Commands is served over Exec."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services._gen.afe.sandbox.v1 import sandbox_pb2_grpc
from services.common.errors import FailedPrecondition, PeerUnavailable
from services.scheduler.sandboxes.brokers import SandboxClient
from tests.support.temp_roots import remove_temp_root, temp_root

pytestmark = pytest.mark.timeout(60)


class ScriptedBroker(sandbox_pb2_grpc.SandboxBrokerServicer):
    """Answers each command by its argv[0]: `echo` prints argv[1:], `fail`
    ends with an error event, `hang` prints once and waits, `die` prints once
    and ends the whole stream with a status that is not the broker's own."""

    def __init__(self) -> None:
        self.inputs: list[pb.CommandInput] = []
        self.streams = 0
        self.execs = 0

    async def Commands(self, request_iterator, context):
        self.streams += 1
        async for msg in request_iterator:
            self.inputs.append(msg)
            if msg.WhichOneof("input") != "run":
                continue
            argv = list(msg.run.argv)
            if argv[0] == "echo":
                yield pb.CommandEvent(id=msg.id, exec=pb.ExecEvent(stdout=" ".join(argv[1:]).encode()))
                yield pb.CommandEvent(id=msg.id, exec=pb.ExecEvent(exit=pb.ExecExit(code=0)))
            elif argv[0] == "fail":
                yield pb.CommandEvent(id=msg.id, error=pb.CommandError(code="FAILED_PRECONDITION",
                                                                       message="the sandbox is frozen"))
            elif argv[0] in ("hang", "die"):
                yield pb.CommandEvent(id=msg.id, exec=pb.ExecEvent(stdout=b"started"))
                if argv[0] == "die":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")


class ExecOnly(sandbox_pb2_grpc.SandboxBrokerServicer):
    """An older broker: Exec only (Commands answers UNIMPLEMENTED, the generated default)."""

    def __init__(self) -> None:
        self.execs = 0

    async def Exec(self, request, context):
        self.execs += 1
        yield pb.ExecEvent(stdout=b"over exec")
        yield pb.ExecEvent(exit=pb.ExecExit(code=3))


async def _serve(servicer, sock: Path) -> grpc.aio.Server:
    server = grpc.aio.server()
    sandbox_pb2_grpc.add_SandboxBrokerServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{sock}")
    await server.start()
    return server


async def _collect(client: SandboxClient, argv: list[str]) -> list[pb.ExecEvent]:
    return [ev async for ev in client.exec("t1", argv)]


@pytest.fixture
def sock():
    d = temp_root("cmdstream")
    try:
        yield d / "sandbox.sock"
    finally:
        remove_temp_root(d)


def test_events_errors_and_early_stop(sock):
    async def body() -> None:
        broker = ScriptedBroker()
        server = await _serve(broker, sock)
        client = SandboxClient(str(sock), None)
        try:
            a, b = await asyncio.gather(_collect(client, ["echo", "a"]), _collect(client, ["echo", "b"]))
            assert (a[0].stdout, a[-1].exit.code, b[0].stdout) == (b"a", 0, b"b")
            assert broker.streams == 1                      # both on one stream
            with pytest.raises(FailedPrecondition, match="frozen"):
                await _collect(client, ["fail"])
            gen = client.exec("t1", ["hang"])
            assert (await gen.__anext__()).stdout == b"started"
            await gen.aclose()                              # stops reading: the broker is told to cancel it
            hang_id = next(m.id for m in broker.inputs if m.WhichOneof("input") == "run" and m.run.argv[0] == "hang")
            for _ in range(100):
                if any(m.WhichOneof("input") == "cancel" for m in broker.inputs):
                    break
                await asyncio.sleep(0.02)
            cancels = [m.id for m in broker.inputs if m.WhichOneof("input") == "cancel"]
            assert cancels == [hang_id]                     # only the abandoned command, none of the finished ones
            assert broker.execs == 0
        finally:
            await client.close()
            await server.stop(0)

    asyncio.run(body())


def test_broken_stream_fails_its_commands_and_the_next_opens_a_new_one(sock):
    async def body() -> None:
        broker = ScriptedBroker()
        server = await _serve(broker, sock)
        client = SandboxClient(str(sock), None)
        try:
            with pytest.raises(PeerUnavailable, match="went away"):
                await _collect(client, ["die"])
            assert (await _collect(client, ["echo", "again"]))[0].stdout == b"again"
            assert broker.streams == 2
            # the broker itself goes away mid-command (a restart): PeerUnavailable, then a new stream
            gen = client.exec("t1", ["hang"])
            assert (await gen.__anext__()).stdout == b"started"
            await server.stop(0)
            with pytest.raises(PeerUnavailable):
                await gen.__anext__()
            server = await _serve(broker, sock)
            assert (await _collect(client, ["echo", "back"]))[0].stdout == b"back"
            assert broker.streams == 3
        finally:
            await client.close()
            await server.stop(0)

    asyncio.run(body())


def test_a_broker_without_commands_is_served_over_exec(sock):
    async def body() -> None:
        broker = ExecOnly()
        server = await _serve(broker, sock)
        client = SandboxClient(str(sock), None)
        try:
            for _ in range(2):
                events = await _collect(client, ["anything"])
                assert (events[0].stdout, events[-1].exit.code) == (b"over exec", 3)
            assert client.commands.unsupported and broker.execs == 2
        finally:
            await client.close()
            await server.stop(0)

    asyncio.run(body())


def test_the_scheduler_keeps_below_the_brokers_limit_per_stream():
    """A cancelled command's slot is free in the scheduler before the broker has
    read the cancel: the broker's limit must leave room for that."""
    from services.sandbox.commands import stream as commands
    from services.scheduler.sandboxes import commandstream

    assert commandstream.MAX_LIVE * 2 <= commands.MAX_LIVE
