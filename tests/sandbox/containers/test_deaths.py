"""What the broker says when a sandbox is killed under a command
(services/sandbox/containers/deaths.py), how a gVisor exec holds back runsc's last
words, and the one engine `wait` shared by a container's commands. Fast: no
Docker here (tests/sandbox/containers/test_r6_killed_at_a_limit.py runs it for real)."""

from __future__ import annotations

import asyncio
import struct

import pytest

from services.sandbox.commands.execs import PID_WORD, RUNSC_LOST, InnerPidExec
from services.sandbox.containers import deaths
from services.sandbox.containers.dockerapi import STDERR, STDOUT, ExecStream

MIB = 1024 * 1024
# As runsc 20221219 writes it on the exec's stderr when its sandbox is gone.
RUNSC_LINE = (b'waiting on pid 3: waiting on PID 3 in sandbox "66bdf5bdd44150bc2ace682668225adcca2a62e0a4d191376eda1fd'
              b'57d9ae21b": urpc method "containerManager.WaitPID" failed: EOF\n')


@pytest.mark.parametrize(("n", "text"), [(512 * MIB, "512 MiB"), (1024 * MIB, "1 GiB"), (1536 * MIB, "1536 MiB"),
                                         (64 * MIB, "64 MiB"), (1000, "1000 bytes")])
def test_a_memory_limit_is_written_as_a_person_reads_it(n, text):
    assert deaths.size_text(n) == text


def test_a_sandbox_killed_for_memory_names_the_limit_and_the_setting():
    text = deaths.stopped_reason({"OOMKilled": True, "ExitCode": 137}, {"Memory": 512 * MIB}, gvisor=True)
    assert text.startswith("the sandbox was killed: it reached its memory limit of 512 MiB (sandbox.limits.memory)")
    assert "raise the Workspace's sandbox.limits.memory" in text


def test_a_gvisor_kernel_that_stopped_names_the_pids_limit_of_the_workspace():
    text = deaths.stopped_reason({"OOMKilled": False, "ExitCode": 2}, {"PidsLimit": 2048}, gvisor=True)
    assert "process limit of 256 (sandbox.limits.pids; the engine's limit of 2048 tasks" in text


def test_any_other_stop_says_only_what_is_known():
    for state, gvisor in (({"ExitCode": 2}, False), ({"ExitCode": 137}, True)):
        assert deaths.stopped_reason(state, {"Memory": MIB, "PidsLimit": 8}, gvisor) == (
            f"the sandbox stopped (exit code {state['ExitCode']}) while the command ran")


def test_runc_oom_of_one_command_says_the_command_was_killed():
    assert deaths.memory_reason(64 * MIB, whole=False).startswith(
        "the command was killed: the sandbox reached its memory limit of 64 MiB (sandbox.limits.memory)")


def _frames(*frames: tuple[int, bytes], eof: bool = True) -> ExecStream:
    reader = asyncio.StreamReader()
    for kind, data in frames:
        reader.feed_data(bytes([kind, 0, 0, 0]) + struct.pack(">I", len(data)) + data)
    if eof:
        reader.feed_eof()
    return ExecStream(reader, writer=None)  # type: ignore[arg-type]  # never written in these tests


async def _read_all(ex: InnerPidExec) -> list[tuple[int, bytes]]:
    out = []
    while (f := await ex.frame()) is not None:
        out.append(f)
    return out


async def test_runscs_last_words_are_held_back_for_the_runner():
    assert RUNSC_LOST.fullmatch(RUNSC_LINE)
    ex = InnerPidExec(None, "e", _frames((STDOUT, PID_WORD + b" 7\n"), (STDOUT, b"hi\n"), (STDERR, RUNSC_LINE)),
                      "c")  # type: ignore[arg-type]
    assert await _read_all(ex) == [(STDOUT, b"hi\n")]
    assert ex.pid == 7 and ex.runsc_lost == RUNSC_LINE


async def test_the_same_words_followed_by_more_output_are_passed_on_in_order():
    ex = InnerPidExec(None, "e", _frames((STDOUT, PID_WORD + b" 7\n"), (STDERR, RUNSC_LINE), (STDOUT, b"more\n"),
                                         (STDERR, RUNSC_LINE), (STDERR, b"x\n")), "c")  # type: ignore[arg-type]
    assert await _read_all(ex) == [(STDERR, RUNSC_LINE), (STDOUT, b"more\n"), (STDERR, RUNSC_LINE), (STDERR, b"x\n")]
    assert ex.runsc_lost == b""


class _Engine:
    """The one engine call a DeathWatch makes, answered when the test says."""

    def __init__(self) -> None:
        self.waits = 0
        self.stopped = asyncio.Event()

    async def wait_stopped(self, container: str) -> int:
        self.waits += 1
        await self.stopped.wait()
        return 137


async def test_a_containers_commands_share_one_wait_ended_with_the_last_of_them():
    engine = _Engine()
    watch = deaths.DeathWatch(engine)  # type: ignore[arg-type]
    with watch.watching("c1") as w1:
        with watch.watching("c1") as w2:
            assert w1 is w2
        await asyncio.sleep(0)
        assert not w1.done() and engine.waits == 1
    await asyncio.sleep(0)
    assert w1.cancelled() and not deaths.died(w1)
    with watch.watching("c1") as w3:          # a new command: a new wait
        engine.stopped.set()
        assert await w3 == 137 and deaths.died(w3) and engine.waits == 2
