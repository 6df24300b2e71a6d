"""The Commands stream (services/sandbox/commands/stream.py) on a real broker: many
commands over one stream run as Exec runs them (output, exit codes, caps,
timeouts), concurrently and told apart by id; `cancel` and a cancelled
stream kill the command's process group; an error ends only its own
command; the scheduler's client (SandboxClient.exec over CommandStream)
sees the same events as over Exec."""

from __future__ import annotations

import asyncio
import queue
import time

import grpc
import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.common.errors import NotFound
from services.scheduler.sandboxes.brokers import SandboxClient
from tests.sandbox.conftest import run

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]


class Stream:
    """A Commands call on the sync stub, fed from a queue."""

    def __init__(self, stub) -> None:
        self.inputs: queue.Queue = queue.Queue()
        self.call = stub.Commands(iter(self.inputs.get, None), timeout=90)

    def run(self, cid: int, ticket: str, cmd: str, **kw) -> None:
        kw.setdefault("timeout_ms", 30000)
        self.inputs.put(pb.CommandInput(id=cid, run=pb.ExecRequest(ticket_id=ticket, argv=["bash", "-c", cmd], **kw)))

    def cancel(self, cid: int) -> None:
        self.inputs.put(pb.CommandInput(id=cid, cancel=True))

    def close(self) -> None:
        self.inputs.put(None)

    def until_ended(self, ids: set[int]) -> dict[int, list]:
        """Every event per id until each of `ids` has its exit or error."""
        seen: dict[int, list] = {}
        left = set(ids)
        for ev in self.call:
            seen.setdefault(ev.id, []).append(ev)
            last = ev.WhichOneof("event") == "error" or ev.exec.WhichOneof("event") == "exit"
            if last:
                left.discard(ev.id)
            if not left:
                break
        return seen


def _out(events: list) -> tuple[bytes, bytes, pb.ExecExit | None]:
    out = b"".join(e.exec.stdout for e in events if e.WhichOneof("event") == "exec")
    err = b"".join(e.exec.stderr for e in events if e.WhichOneof("event") == "exec")
    ex = next((e.exec.exit for e in events if e.WhichOneof("event") == "exec" and e.exec.HasField("exit")), None)
    return out, err, ex


def _sleepers(stub, ticket: str, tag: str) -> int:
    return int(run(stub, ticket, f"ps -eo args | grep -c '^sleep {tag}' || true").stdout.strip())


def test_commands_run_concurrently_on_one_stream_as_exec_runs_them(stub, plain_sandbox):
    s = Stream(stub)
    s.run(1, plain_sandbox, "sleep 1; echo slow")
    s.run(2, plain_sandbox, "echo out; echo err >&2; exit 7")
    s.run(3, plain_sandbox, "head -c 100000 /dev/zero | tr '\\0' x", output_cap_bytes=4096)
    s.run(4, plain_sandbox, "sleep 30", timeout_ms=300)
    t0 = time.monotonic()
    seen = s.until_ended({1, 2, 3, 4})
    s.close()
    assert time.monotonic() - t0 < 20
    order = [i for i in seen]   # first event per id, in arrival order
    assert order.index(2) < order.index(1)          # the quick one did not wait for the slow one
    assert _out(seen[1])[0] == b"slow\n" and _out(seen[1])[2].code == 0
    out, err, ex = _out(seen[2])
    assert (out, err, ex.code) == (b"out\n", b"err\n", 7)
    out, err, ex = _out(seen[3])
    assert len(out) == 4096 and ex.truncated and b"output truncated after 4096 bytes" in err
    assert _out(seen[4])[2].timed_out and _out(seen[4])[2].code == -1


def test_commands_error_ends_only_its_own_command(stub, plain_sandbox):
    s = Stream(stub)
    s.run(1, "no-such-ticket", "true")
    s.run(2, plain_sandbox, "echo fine")
    seen = s.until_ended({1, 2})
    s.close()
    assert seen[1][-1].error.code == "NOT_FOUND" and "no-such-ticket" in seen[1][-1].error.message
    assert _out(seen[2])[:1] == (b"fine\n",) and _out(seen[2])[2].code == 0


def test_commands_cancel_kills_the_process_group(stub, plain_sandbox):
    s = Stream(stub)
    s.run(1, plain_sandbox, "sleep 311 & sleep 311; echo never")
    s.run(2, plain_sandbox, "sleep 312 & sleep 312; echo never")
    deadline = time.monotonic() + 20
    while (_sleepers(stub, plain_sandbox, "311") < 2 or _sleepers(stub, plain_sandbox, "312") < 2) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    s.cancel(1)
    deadline = time.monotonic() + 20
    while _sleepers(stub, plain_sandbox, "311") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _sleepers(stub, plain_sandbox, "311") == 0          # cancelled: its whole group is gone
    assert _sleepers(stub, plain_sandbox, "312") == 2          # control: the other command still runs
    s.call.cancel()                                            # the whole stream: its commands go too
    deadline = time.monotonic() + 20
    while _sleepers(stub, plain_sandbox, "312") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _sleepers(stub, plain_sandbox, "312") == 0


def test_commands_refuses_a_second_command_under_a_live_id(stub, plain_sandbox):
    s = Stream(stub)
    s.run(5, plain_sandbox, "sleep 20")
    s.run(5, plain_sandbox, "true")
    with pytest.raises(grpc.RpcError) as info:
        s.until_ended({5})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already running" in info.value.details()
    s.close()


def test_scheduler_client_over_the_stream_matches_exec(stub, broker, plain_sandbox):
    async def body() -> None:
        client = SandboxClient(broker.socket, broker.secret)
        try:
            async def collect(cmd: str, **kw) -> list:
                return [ev async for ev in client.exec(plain_sandbox, ["bash", "-c", cmd], timeout_ms=30000, **kw)]

            many = await asyncio.gather(*(collect(f"echo {i}; exit {i % 3}") for i in range(12)))
            assert client.commands._stream is not None and not client.commands.unsupported   # the stream was used
            for i, events in enumerate(many):
                assert b"".join(e.stdout for e in events) == f"{i}\n".encode()
                assert events[-1].exit.code == i % 3
            # the same command over Exec gives the same events
            over_exec = [ev for ev in stub.Exec(pb.ExecRequest(ticket_id=plain_sandbox, argv=["bash", "-c", "echo 4; exit 1"],
                                                               timeout_ms=30000))]
            assert [e.stdout for e in many[4][:-1]] == [e.stdout for e in over_exec[:-1]]
            assert many[4][-1].exit.code == over_exec[-1].exit.code
            with pytest.raises(NotFound):
                async for _ in client.exec("no-such-ticket", ["true"]):
                    pass
            # a caller that stops reading early cancels its command on the broker
            gen = client.exec(plain_sandbox, ["bash", "-c", "echo started; sleep 313 & sleep 313"], timeout_ms=60000)
            first = await gen.__anext__()
            assert first.stdout == b"started\n"
            await gen.aclose()
            for _ in range(200):
                if not _sleepers(stub, plain_sandbox, "313"):
                    break
                await asyncio.sleep(0.1)
            assert _sleepers(stub, plain_sandbox, "313") == 0
        finally:
            await client.close()

    asyncio.run(body())
