"""R12 after a crash: `kill -9` of the sandbox broker while a ticket's command
runs. The ticket fails with a clear reason; the restarted broker is noticed
by the scheduler (new boot id), which reconciles and retries the failed
teardown, so the ticket's sandbox, egress proxy and network go within a
bounded time; and after `afe up` stops nothing of the instance is left.

Positive control: with the scheduler's recovery turned off
(`--broker-recovery 0`), the same crash leaves the container, proxy and
network behind even after `afe up` has stopped, and (in the disk cap's
mount mode, R34) the workspace's loop mount. Either way the test's own
clean-up removes all of it: nothing of the test is left afterwards.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import time

import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc
from services.common import demo
from services.common.rpc.grpcutil import open_channel
from services.sandbox.files import diskcap
from tests.scheduler.conftest import payload, state_name, wait_for_event, wait_for_state
from tests.support.temp_roots import disk_caps_left, remove_temp_root, temp_root

from .launcher_support import base_env, start_afe

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

CONFIG = """\
kind: Workspace
name: calc
repo: repos/calc.git
tokenEnv: R12_GIT_TOKEN
forge: {type: local}
sandbox:
  egress: [pypi.org]
---
kind: Workflow
name: nap
workspace: calc
nodes:
  - {id: nap, run: "echo napping && sleep 60", timeout: 120}
"""


def _docker_ids(kind: str, *labels: str) -> list[str]:
    argv = ["docker", kind, "ls", "-q", "--no-trunc"]
    if kind == "container":
        argv.append("-a")
    for label in labels:
        argv += ["--filter", f"label={label}"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()


def _objects(instance: str, ticket: str | None = None) -> dict[str, list[str]]:
    labels = [f"afe.instance={instance}", f"afe.ticket={ticket}" if ticket else "afe.ticket"]
    return {"containers": _docker_ids("container", *labels), "networks": _docker_ids("network", *labels)}


def _cleanup(instance: str) -> None:
    left = _objects(instance)
    if left["containers"]:
        subprocess.run(["docker", "rm", "-f", "-v", *left["containers"]], capture_output=True, check=False)
    for net in left["networks"]:
        subprocess.run(["docker", "network", "rm", net], capture_output=True, check=False)


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout:.0f} s")


@pytest.mark.parametrize("recovery", [True, False], ids=["recovery", "positive-control-no-recovery"])
async def test_r12_sandbox_broker_killed_mid_exec_leaves_nothing_behind(recovery):
    base = temp_root("afe-r12-")
    cfg = demo.materialize(base / "cfg")
    (cfg / "afe.yaml").unlink()
    (cfg / "demo-model.yaml").unlink()     # a replay script: not a manifest unless a Model names it
    (cfg / "test.yaml").write_text(CONFIG)
    instance = f"r12-{secrets.token_hex(4)}"
    extra = ["--instance", instance] + ([] if recovery else ["--broker-recovery", "0"])
    running = start_afe(base, base_env(R12_GIT_TOKEN="r12-unused-token"), *extra)
    try:
        st = await asyncio.to_thread(running.wait_up)
        key = bytes.fromhex((running.run_dir / "automation.key").read_text().strip())
        async with open_channel(str(running.run_dir / "scheduler.sock"), key) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            t = await stub.CreateTicket(pb.CreateTicketRequest(workflow="nap", title="nap"))
            try:
                await wait_for_event(stub, t.id, lambda e: e.type == "node.output" and "napping" in payload(e)["text"])
            except AssertionError as exc:
                got = await stub.GetTicket(pb.GetTicketRequest(id=t.id))
                raise AssertionError(f"{exc}: {state_name(got)}: {got.error}\n{running.text()[-3000:]}") from None
            before = _objects(instance, t.id)
            assert len(before["containers"]) == 2 and len(before["networks"]) == 1, before  # sandbox + proxy

            victim = st["children"]["sandbox"]["pid"]
            os.kill(victim, signal.SIGKILL)
            # kill -9: the broker ran no cleanup and is not back yet (the launcher waits >= 1 s).
            assert _objects(instance, t.id) == before

            done = await wait_for_state(stub, t.id, {"failed", "succeeded", "cancelled"}, deadline_s=120)
            assert state_name(done) == "failed"
            assert "the sandbox broker went away during the command" in done.error, done.error
            for transport in ("Socket closed", "recvmsg", "Connection reset", "failed to connect"):
                assert transport not in done.error, done.error

            def restarted() -> bool:
                child = (running.state() or {"children": {}})["children"].get("sandbox") or {}
                return child.get("pid") not in (None, victim) and child.get("ready")
            await asyncio.to_thread(_wait, restarted, 60, "the sandbox broker was not restarted")

            if recovery:
                gone = await asyncio.to_thread(
                    _wait, lambda: _objects(instance, t.id) == {"containers": [], "networks": []}, 60,
                    "the failed ticket's sandbox, proxy and network were not removed after the broker restarted")
                assert gone
        assert running.stop() == 0, running.text()[-3000:]
        left = _objects(instance)
        caps = disk_caps_left([base])
        if recovery:
            assert left == {"containers": [], "networks": []}, left
            assert caps == [], caps
        else:
            # Positive control: without the reconcile/teardown retry the crash leaves it all behind.
            assert sorted(left["containers"]) == sorted(before["containers"]), left
            assert left["networks"] == before["networks"], left
            if diskcap.detect_mode()[0] == diskcap.MODE_MOUNT:
                workspace = str(running.data / "workspaces" / t.id)
                assert any(c.startswith(f"mount {workspace} ") for c in caps), caps
    finally:
        running.stop()
        _cleanup(instance)        # containers and networks first: they hold the workspace mount
        remove_temp_root(base)    # then the disk cap's mount and loop device, then the folder
    # Whatever the crash left, the test's clean-up leaves nothing of it.
    assert _objects(instance) == {"containers": [], "networks": []}
    assert disk_caps_left([base]) == [] and not base.exists()
