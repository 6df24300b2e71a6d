"""R6 at work: a command whose sandbox reaches its memory or pids limit fails
at once and says which limit, under both runtimes.

Under gVisor the whole sandbox is killed and Docker keeps the exec's stream
open (runsc's `urpc ... WaitPID failed: EOF`, then nothing), so without the
broker's death watch (services/sandbox/containers/deaths.py) the command waits for its
deadline: the positive control shows that, with a short deadline."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.common.layout import Layout
from services.sandbox.commands.execs import Exit, Output, Runner
from services.sandbox.containers.deaths import DeathWatch
from services.sandbox.containers.dockerapi import DockerAPI
from services.sandbox.containers.hardening import SandboxSettings
from services.sandbox.sandboxes import SandboxManager
from tests.sandbox.conftest import gvisor_missing, run, spec_runtime
from tests.support.sandbox_broker import new_instance

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]

MIB = 1024 * 1024
HOG = ["python3", "-c", "b = bytearray(512 * 1024 * 1024); print('allocated', len(b))"]
# The node's deadline: the command must fail long before it.
DEADLINE_MS = 100_000
# Generous under a loaded CI machine; measured about 1 s (the report of issue 35).
FAILS_WITHIN_S = 30


def _sandbox(stub, runtime: str, limits: pb.Limits):
    ticket = "lim-" + new_instance("k")
    stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(
        limits=limits, runtime=spec_runtime(runtime))))
    try:
        yield ticket
    finally:
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))


@pytest.fixture
def limited_sandbox(stub, runtime):
    """A fresh sandbox with 64 MiB of memory (each test kills one)."""
    yield from _sandbox(stub, runtime, pb.Limits(memory_bytes=64 * MIB))


@pytest.fixture
def few_pids_sandbox(stub, runtime):
    """A fresh sandbox with 64 processes and room in memory (1 GiB) for them."""
    yield from _sandbox(stub, runtime, pb.Limits(pids=64, memory_bytes=1024 * MIB))


def test_r6_a_command_killed_at_the_memory_limit_fails_at_once_naming_the_limit(stub, limited_sandbox, runtime):
    t0 = time.monotonic()
    r = run(stub, limited_sandbox, HOG, timeout_ms=DEADLINE_MS)
    took = time.monotonic() - t0
    print(f"{runtime}: the memory-killed command failed after {took:.2f} s")
    assert took < FAILS_WITHIN_S and not r.exit.timed_out
    assert r.code == 137 and b"allocated" not in r.stdout
    if runtime == "gvisor":
        # the whole sandbox was killed: said so, and runsc's own words are not passed on
        assert (b"the sandbox was killed: it reached its memory limit of 64 MiB (sandbox.limits.memory)"
                in r.stderr), r.stderr
        assert b"urpc" not in r.stderr
        # the next command is refused with the same reason
        with pytest.raises(grpc.RpcError) as ei:
            run(stub, limited_sandbox, "true")
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "memory limit of 64 MiB" in ei.value.details()
    else:
        # runc: the kernel's OOM killer ended the command; the sandbox lives on
        assert (b"the command was killed: the sandbox reached its memory limit of 64 MiB (sandbox.limits.memory)"
                in r.stderr), r.stderr
        assert run(stub, limited_sandbox, "echo alive").stdout == b"alive\n"


def test_r6_an_interactive_process_killed_at_the_memory_limit_ends_at_once_naming_it(stub, limited_sandbox,
                                                                                      runtime):
    """An agent runs as a Process (no deadline at all): it must end too."""
    def inputs():
        yield pb.ProcessInput(start=pb.ProcessStart(ticket_id=limited_sandbox, argv=HOG))
    t0 = time.monotonic()
    outs = list(stub.Process(inputs(), timeout=FAILS_WITHIN_S * 2))
    took = time.monotonic() - t0
    print(f"{runtime}: the memory-killed process ended after {took:.2f} s")
    stderr = b"".join(o.stderr for o in outs if o.WhichOneof("output") == "stderr")
    (code,) = [o.exit.code for o in outs if o.WhichOneof("output") == "exit"]
    assert took < FAILS_WITHIN_S and code == 137
    assert b"memory limit of 64 MiB (sandbox.limits.memory)" in stderr, stderr


FORK_BOMB = ["python3", "-c", """
import os, signal
pids, err = [], "none"
try:
    for i in range(2000):
        pid = os.fork()
        if pid == 0:
            signal.pause()
            os._exit(0)
        pids.append(pid)
except OSError as e:
    err = str(e.errno)
print(len(pids), err, flush=True)
for p in pids:
    os.kill(p, 9)
    os.waitpid(p, 0)
"""]


def test_r6_a_fork_bomb_at_the_pids_limit_fails_at_once(stub, few_pids_sandbox, runtime):
    t0 = time.monotonic()
    r = run(stub, few_pids_sandbox, FORK_BOMB, timeout_ms=DEADLINE_MS)
    took = time.monotonic() - t0
    print(f"{runtime}: the fork bomb's command ended after {took:.2f} s")
    assert took < FAILS_WITHIN_S and not r.exit.timed_out
    if runtime == "runc":
        # runc: fork meets EAGAIN at the limit and the command goes on (and ends) by itself
        started, err = r.stdout.split()
        assert int(started) < 64 and err == b"11" and r.code == 0
    else:
        # gVisor: its kernel cannot start a thread at the engine's limit and the sandbox ends
        assert r.code == 137 and b"urpc" not in r.stderr
        assert (b"as it does when the sandbox reaches its process limit of 64 (sandbox.limits.pids; the engine's "
                b"limit of 512 tasks counts gVisor's own threads too)" in r.stderr), r.stderr


class _Blind(DeathWatch):
    """The control: a watch that never sees the sandbox stop (the broker before the fix)."""

    async def _wait(self, container_id: str) -> int | None:
        await asyncio.Event().wait()
        return None


async def test_r6_gvisor_control_without_the_death_watch_the_command_waits_for_its_deadline(tmp_path, docker_client):
    if why := gvisor_missing(docker_client):
        pytest.skip(why)
    layout = Layout(tmp_path / "data", tmp_path / "run")
    layout.ensure()
    mgr = SandboxManager(layout, instance=new_instance("lk"), client=docker_client)
    api = DockerAPI()
    seen = []
    try:
        # On a loaded machine gVisor sometimes ends the hog itself (exit 128): the hang is shown when
        # one of two fresh sandboxes waits for its deadline.
        for _ in range(2):
            ticket = "ctl-" + new_instance("k")
            await mgr.create(SandboxSettings(ticket_id=ticket, memory_bytes=64 * MIB, runtime="gvisor"))
            t0 = time.monotonic()
            events = [ev async for ev in Runner(mgr, api, death_watch=_Blind(api)).run_exec(ticket, HOG,
                                                                                         timeout_ms=8000)]
            took = time.monotonic() - t0
            (end,) = [ev for ev in events if isinstance(ev, Exit)]
            stderr = b"".join(ev.data for ev in events if isinstance(ev, Output) and ev.stream == "stderr")
            seen.append((end.code, end.timed_out, round(took, 1)))
            await mgr.destroy(ticket)
            if end.timed_out and took >= 8 and b"memory limit" not in stderr:
                break       # it hung until its deadline
        else:
            pytest.fail(f"without the death watch the hog never hung until its deadline: {seen}")
    finally:
        await mgr.reconcile([])
