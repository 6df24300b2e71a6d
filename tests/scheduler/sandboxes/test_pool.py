"""Warm sandboxes (services/scheduler/sandboxes/pool.py): a pooled sandbox is made for
a reserved ticket id, given to exactly one ticket, carries that ticket's
`afe.ticket` label from birth (R12), is destroyed with it, and never leaks:
the pool refills, a stopping scheduler removes it, and a scheduler that died
leaves nothing that the next start does not remove."""

from __future__ import annotations

import asyncio

import docker
import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.config.manifests import load_config
from services.common.layout import Layout
from tests.scheduler.conftest import state_name, wait_for_state, write_config
from tests.support.system import afe_system

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]

WORKFLOWS = """\
kind: Workflow
name: hello
workspace: ws
nodes:
  - {id: hello, run: "echo hello from $(pwd)"}
"""


async def _sandboxes(sys_) -> dict[str, str]:
    """ticket id -> container id of every sandbox the broker has."""
    r = await sys_.sandbox.ListSandboxes(spb.ListSandboxesRequest())
    return {s.ticket_id: s.container_id for s in r.sandboxes}


async def _until(fn, what: str, deadline_s: float = 120.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        got = await fn()
        if got:
            return got
        if loop.time() > end:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.1)


def _label(container_id: str) -> str:
    c = docker.from_env().api.inspect_container(container_id)
    return c["Config"]["Labels"]["afe.ticket"]


async def test_r12_pooled_sandbox_carries_its_tickets_label_and_goes_with_it(short_tmp):
    cfg = write_config(short_tmp, WORKFLOWS, sandbox_extra="  pool: 1\n")
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout) as sys_:
        pool = sys_.app.engine.pool
        await asyncio.wait_for(pool.filled.wait(), 120)
        before = await _sandboxes(sys_)
        assert len(before) == 1
        # What an operator scrapes: one ready of one wanted.
        assert (_gauge(sys_, "pool_ready"), _gauge(sys_, "pool_wanted")) == (1, 1)
        (reserved, container), = before.items()
        # Made ahead: no ticket has this id yet, and its workspace is prepared and marked.
        with pytest.raises(Exception, match="no ticket"):
            await sys_.stub.GetTicket(pb.GetTicketRequest(id=reserved))
        assert _label(container) == reserved
        assert layout.workspace(reserved).is_dir() and (layout.data_dir / "pool" / reserved).exists()

        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="hello", title="warm"))
        # The ticket got the reserved id: the container made before it carries its label.
        assert t.id == reserved and _label(container) == t.id
        assert not (layout.data_dir / "pool" / reserved).exists()   # the ticket owns it now
        t = await wait_for_state(sys_.stub, t.id, {"succeeded", "failed"})
        assert state_name(t) == "succeeded", t.error
        events = (await sys_.stub.GetTicket(pb.GetTicketRequest(id=t.id)))
        assert events.id == reserved

        # Destroyed with its ticket (R12) and its workspace released; the pool refills with a new id.
        def gone() -> bool:
            try:
                docker.from_env().api.inspect_container(container)
            except docker.errors.NotFound:
                return True
            return False
        await _until(lambda: asyncio.sleep(0, gone()), "the claimed sandbox to go")
        assert not layout.workspace(reserved).exists()
        after = await _until(lambda: _new(sys_, reserved), "the pool to refill")
        (refill, refill_container), = after.items()
        assert _gauge(sys_, "pool_ready") == 1
        assert refill != reserved and _label(refill_container) == refill

        # A second ticket takes the refill, never the first ticket's sandbox (one ticket per sandbox).
        t2 = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="hello", title="warm again"))
        assert t2.id == refill
        t2 = await wait_for_state(sys_.stub, t2.id, {"succeeded", "failed"})
        assert state_name(t2) == "succeeded", t2.error

        # Positive control: a scheduler without a pool gives a new ticket a new id and a new sandbox.
        await sys_.stop_scheduler()
        assert await _sandboxes(sys_) == {}            # the stop removed the pool's refill
        assert not list((layout.data_dir / "pool").iterdir())
        sys_.config = load_config(write_config(short_tmp / "nopool", WORKFLOWS))
        await sys_.start_scheduler()
        assert (_gauge(sys_, "pool_ready"), _gauge(sys_, "pool_wanted")) == (0, 0)
        t3 = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="hello", title="cold"))
        assert t3.id not in before and t3.id not in (refill,)
        await wait_for_state(sys_.stub, t3.id, {"succeeded", "failed"})


def _gauge(sys_, name: str) -> float:
    """The value `afe_sandbox_<name>` has at a scrape of the scheduler's /metrics."""
    return getattr(sys_.app.engine.metrics, name).collect()[0].samples[0].value


async def _new(sys_, old: str) -> dict[str, str]:
    sbs = await _sandboxes(sys_)
    return {k: v for k, v in sbs.items() if k != old} if sys_.app.engine.pool.size() == 1 else {}


async def test_r12_pool_of_a_dead_scheduler_is_reconciled_away(short_tmp):
    cfg = write_config(short_tmp, WORKFLOWS, sandbox_extra="  pool: 1\n")
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout, subprocess=True) as sys_:
        first = await _until(lambda: _sandboxes(sys_), "the pool to fill")
        (reserved, container), = first.items()
        await sys_.kill_scheduler()     # SIGKILL: no cleanup runs
        # Positive control: what the dead scheduler made is all still there.
        assert await _sandboxes(sys_) == first
        assert layout.workspace(reserved).is_dir() and layout.gitdir(reserved).is_dir()
        assert (layout.data_dir / "pool" / reserved).exists()

        await sys_.start_scheduler()
        fresh = await _until(lambda: _other(sys_, reserved), "the new scheduler's pool")
        assert reserved not in await _sandboxes(sys_)
        with pytest.raises(docker.errors.NotFound):
            docker.from_env().api.inspect_container(container)
        assert not layout.workspace(reserved).exists() and not layout.gitdir(reserved).exists()
        assert not (layout.data_dir / "pool" / reserved).exists()
        (new_id, _), = fresh.items()
        assert (layout.data_dir / "pool" / new_id).exists()


async def _other(sys_, old: str) -> dict[str, str]:
    sbs = await _sandboxes(sys_)
    return sbs if sbs and old not in sbs else {}


async def test_r12_broker_restart_reconcile_keeps_the_pool_and_removes_a_dead_schedulers(short_tmp):
    cfg = write_config(short_tmp, WORKFLOWS, sandbox_extra="  pool: 1\n")
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout) as sys_:
        engine = sys_.app.engine
        await asyncio.wait_for(engine.pool.filled.wait(), 120)
        (mine, container), = (await _sandboxes(sys_)).items()
        # A pooled sandbox of a scheduler instance that died: a reserved id no scheduler holds.
        await sys_.sandbox.CreateSandbox(spb.CreateSandboxRequest(ticket_id="t-deadbeef0001",
                                                                  spec=spb.SandboxSpec()))
        assert set(await _sandboxes(sys_)) == {mine, "t-deadbeef0001"}     # positive control
        # The broker "restarted": the scheduler sees a boot id it does not know and reconciles.
        engine.teardowns._broker_boot = "a-previous-broker"
        await _until(lambda: _without(sys_, "t-deadbeef0001"), "the reconcile after the broker restart")
        assert await _sandboxes(sys_) == {mine: container}                  # the live pool's stays
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="hello", title="after"))
        assert t.id == mine


async def _without(sys_, tid: str) -> bool:
    return tid not in await _sandboxes(sys_)


async def test_r12_a_gvisor_pool_hands_its_warm_sandbox_to_the_ticket(short_tmp):
    """sandbox.runtime: gvisor with an egress allowlist and a pool of one: the
    warm sandbox is a gVisor one (no network interface, its proxy through its
    socket), the ticket takes it and runs in it, and it goes with the ticket."""
    if "runsc" not in (docker.from_env().info().get("Runtimes") or {}):
        pytest.skip("the Docker engine has no `runsc` runtime (gVisor); .ci/run registers it (see the README)")
    cfg = write_config(short_tmp, WORKFLOWS,
                       sandbox_extra="  pool: 1\n  runtime: gvisor\n  egress: [registry.npmjs.org]\n")
    layout = Layout(short_tmp / "data", short_tmp / "run")
    async with afe_system(cfg, layout) as sys_:
        await asyncio.wait_for(sys_.app.engine.pool.filled.wait(), 120)
        (reserved, container), = (await _sandboxes(sys_)).items()
        hc = docker.from_env().api.inspect_container(container)["HostConfig"]
        assert hc["Runtime"] == "runsc" and hc["NetworkMode"] == "none"
        t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow="hello", title="warm gvisor"))
        assert t.id == reserved and _label(container) == t.id and t.sandbox_runtime == "gvisor"
        t = await wait_for_state(sys_.stub, t.id, {"succeeded", "failed"})
        assert state_name(t) == "succeeded", t.error
        assert "hello from /workspace" in next(n for n in t.nodes if n.id == "hello").output

        def gone() -> bool:
            try:
                docker.from_env().api.inspect_container(container)
            except docker.errors.NotFound:
                return True
            return False
        await _until(lambda: asyncio.sleep(0, gone()), "the claimed gVisor sandbox to go")
