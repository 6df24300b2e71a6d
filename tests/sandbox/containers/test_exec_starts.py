"""A freeze never lands on an exec that is still starting (execstarts.py).

Pausing a container while `runc exec` is putting a new process into it leaves
that `runc init` in uninterruptible sleep in the frozen cgroup, and the engine
holding its lock on the container: inspect, exec, unpause and remove all hang.
A sandbox frozen for a builtin step right after its create (while the broker
starts the command supervisor) hit exactly this in a loaded test run.

The hang itself is not reproduced here: while an exec hangs, the engine stalls
other containers' work too (a parallel test's proxy start missed its 20 s), so
a control that made it would break the tests beside it. The positive control
shows its cause instead: the exec start as it was returned before the engine
had the process, so a pause right after it landed on the start. With the gate,
the start returns only once the process runs, and a freeze during a start
waits for it: the container pauses and unpauses in time, every round."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import secrets

import docker
import pytest

from services.common.host.images import ensure_images
from services.sandbox.containers.dockerapi import DockerAPI
from services.sandbox.containers.execstarts import ExecStarts

TRIES = 20
CONTROL_TRIES = 60


# ---- the gate alone (no engine) ---------------------------------------------------

async def test_a_freeze_waits_for_starts_and_holds_new_ones_back():
    starts = ExecStarts()
    order: list[str] = []
    started = asyncio.Event()
    release = asyncio.Event()

    async def start(tag: str) -> None:
        async with starts.start("c1"):
            order.append(f"{tag} starting")
            started.set()
            await release.wait()
            order.append(f"{tag} started")

    async def freeze() -> None:
        async with starts.quiet("c1"):
            order.append("paused")
            await asyncio.sleep(0.05)
        order.append("freeze done")

    first = asyncio.create_task(start("a"))
    await started.wait()
    freezing = asyncio.create_task(freeze())
    await asyncio.sleep(0.02)
    late = asyncio.create_task(start("b"))     # comes while the freeze waits: held back
    other = asyncio.create_task(starts.start("c2").__aenter__())    # another container is not held
    await asyncio.wait_for(other, 1)
    assert order == ["a starting"]
    release.set()
    await asyncio.wait_for(asyncio.gather(first, freezing, late), 5)
    assert order == ["a starting", "a started", "paused", "freeze done", "b starting", "b started"]
    assert starts.starting("c1") == 0


async def test_a_freeze_gives_up_with_a_reason_when_a_start_never_ends():
    starts = ExecStarts()
    async with starts.start("c1"):
        with pytest.raises(TimeoutError, match="still starting"):
            async with starts.quiet("c1", timeout=0.1):
                pass
    async with starts.quiet("c1", timeout=0.1):     # the give-up left nothing held
        pass


class _Answers(DockerAPI):
    """exec inspect answered from a list (no engine)."""

    def __init__(self, answers: list[dict]) -> None:
        super().__init__(socket_path="/nonexistent", starts=ExecStarts())
        self.answers, self.calls = answers, 0

    async def exec_inspect(self, exec_id: str) -> dict:
        self.calls += 1
        return self.answers[min(self.calls, len(self.answers)) - 1]


async def test_an_exec_start_waits_for_the_pid_or_the_exit_code_and_no_longer_than_its_limit():
    api = _Answers([{"Pid": 0, "ExitCode": None}, {"Pid": 0, "ExitCode": None}, {"Pid": 4242}])
    assert await api._until_started("e1") and api.calls == 3
    api = _Answers([{"Pid": 0, "ExitCode": 127}])          # it could not run: that is an answer too
    assert await api._until_started("e2") and api.calls == 1
    api = _Answers([{"Pid": 0, "ExitCode": None}])         # the engine never says: the wait ends
    assert not await api._until_started("e3", limit_s=0.05) and api.calls > 1


# ---- against the engine --------------------------------------------------------------

def _thaw_by_hand(container_id: str) -> None:
    """Thaw the container's cgroup (v1 freezer or v2 cgroup.freeze) under the engine's back."""
    for path in glob.glob(f"/sys/fs/cgroup/freezer/**/*{container_id}*/freezer.state", recursive=True):
        with open(path, "w") as f:
            f.write("THAWED")
    for path in glob.glob(f"/sys/fs/cgroup/**/*{container_id}*/cgroup.freeze", recursive=True):
        with open(path, "w") as f:
            f.write("0")


@pytest.fixture
def container():
    ensure_images(progress=lambda _m: None)
    client = docker.from_env(timeout=30)
    c = client.containers.run("afe/sandbox:latest", ["sleep", "infinity"], detach=True, init=True,
                              name=f"afe-test-execstarts-{secrets.token_hex(4)}",
                              labels={"afe.instance": "test-execstarts"})
    try:
        yield client, c.id
    finally:
        _thaw_by_hand(c.id)
        with contextlib.suppress(docker.errors.APIError):
            client.api.unpause(c.id)
        client.api.remove_container(c.id, force=True)


async def _race(client: docker.DockerClient, cid: str, api: DockerAPI, *, concurrent: bool) -> bool:
    """Start an exec and pause the container at once: right after the start
    returns, or (`concurrent`) while it is in flight, through the gate as a
    freeze does. True when the exec was left stuck."""
    exec_id = await api.exec_create(cid, ["true"], workdir="/", env=[], stdin=False)
    if concurrent:
        starting = asyncio.create_task(api.exec_start(exec_id, container=cid))
        while not api.starts.starting(cid) and not starting.done():  # noqa: ASYNC110 - one loop step at a time until the start enters the gate
            await asyncio.sleep(0)
        async with api.starts.quiet(cid):
            await asyncio.to_thread(client.api.pause, cid)
        stream = await asyncio.wait_for(starting, 10)
    else:
        stream = await api.exec_start(exec_id, container=cid)
        await asyncio.to_thread(client.api.pause, cid)
    # The engine takes the container's lock to unpause: an exec stuck in the frozen cgroup holds it.
    unpausing = asyncio.ensure_future(asyncio.to_thread(client.api.unpause, cid))
    done, _ = await asyncio.wait({unpausing}, timeout=10)
    stuck = not done
    if stuck:
        _thaw_by_hand(cid)
    with contextlib.suppress(docker.errors.APIError, TimeoutError):
        await asyncio.wait_for(unpausing, 60)
    stream.close()
    return stuck


class _UngatedStart(DockerAPI):
    """The exec start as it was: it returned at the engine's upgrade, before the
    engine had run the process."""

    async def _until_started(self, exec_id: str, limit_s: float = 0.0) -> bool:
        return True


async def _returned_before_the_process(client: docker.DockerClient, cid: str, api: DockerAPI) -> bool:
    """Start an exec and ask the engine at once whether it has the process yet."""
    exec_id = await api.exec_create(cid, ["true"], workdir="/", env=[], stdin=False)
    stream = await api.exec_start(exec_id, container=cid)
    try:
        doc = await asyncio.wait_for(asyncio.to_thread(client.api.exec_inspect, exec_id), 30)
        return not doc.get("Pid") and doc.get("ExitCode") is None
    finally:
        stream.close()


@pytest.mark.docker
@pytest.mark.timeout(300)
async def test_positive_control_the_start_as_it_was_returned_before_the_engine_had_the_process(container):
    client, cid = container
    early = [await _returned_before_the_process(client, cid, _UngatedStart(starts=ExecStarts()))
             for _ in range(CONTROL_TRIES)]
    assert any(early), f"the old start never returned early in {CONTROL_TRIES} tries: the control shows nothing"
    gated = DockerAPI(starts=ExecStarts())
    assert not any([await _returned_before_the_process(client, cid, gated) for _ in range(CONTROL_TRIES)])


@pytest.mark.docker
@pytest.mark.timeout(300)
async def test_a_freeze_during_an_exec_start_waits_for_it_and_nothing_is_stuck(container):
    client, cid = container
    api = DockerAPI(starts=ExecStarts())
    for i in range(TRIES):
        assert not await _race(client, cid, api, concurrent=bool(i % 2)), i
    assert api.starts.starting(cid) == 0
