"""Two `afe up` on one Docker engine (issue 35 walk): each data folder has its
own `afe.instance`, so one afe never removes the other's sandboxes.

A new user runs the demo (`make run` in afe's checkout), then `afe up` in
their own repository; "port taken" tells them to pass `--listen`. Both used
the label `afe.instance=default`, and a sandbox broker's start removes every
object of its instance whose ticket its scheduler does not know (R12
reconcile): the second start removed the first afe's sandboxes — of a ticket
waiting for approval, or running — and its Ctrl-C listed them as its own.

Positive control: a third `afe up` given the first one's instance (what the
shared default was) removes the running ticket's sandbox at its start.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc
from services.common import demo
from services.common.errors import ConfigError
from services.common.layout import INSTANCE_RE, Layout
from services.common.rpc.grpcutil import open_channel
from services.launcher import instance
from tests.scheduler.conftest import payload, state_name, wait_for_event, wait_for_state
from tests.support.temp_roots import remove_temp_root, temp_root

from .launcher_support import Afe, base_env, start_afe
from .test_r12_crash_teardown import _cleanup, _objects

CONFIG = """\
kind: Workspace
name: calc
repo: repos/calc.git
forge: {type: local}
---
kind: Workflow
name: nap
workspace: calc
nodes:
  - {id: nap, run: "echo napping && sleep 120", timeout: 300}
"""


# -- which id (no Docker) ---------------------------------------------------------

def test_a_new_data_folder_gets_its_own_id_and_keeps_it(tmp_path):
    one = Layout(tmp_path / "shop" / ".afe" / "data", tmp_path / "shop" / ".afe" / "run")
    other = Layout(tmp_path / "My Repo" / ".afe" / "data", tmp_path / "My Repo" / ".afe" / "run")
    first = instance.resolve(one, None)
    assert re.fullmatch(r"shop-[0-9a-f]{6}", first) and INSTANCE_RE.match(first), first
    assert (one.data_dir / "instance").read_text() == first + "\n"
    assert instance.resolve(one, None) == first            # kept: the next start finds its sandboxes
    second = instance.resolve(other, None)
    assert re.fullmatch(r"my-repo-[0-9a-f]{6}", second) and second != first, second
    assert instance.new_id(Layout(tmp_path / "var" / "afe", tmp_path / "run")).startswith("afe-")


def test_a_data_folder_used_before_keeps_default_and_a_given_id_wins(tmp_path):
    # Control: a data folder an earlier afe ran on (its store, token or workspaces) has
    # sandboxes labelled `default`; a new id would orphan them.
    for made in ("afe.db", "ui-token", "workspaces"):
        layout = Layout(tmp_path / made / "data", tmp_path / made / "run")
        layout.data_dir.mkdir(parents=True)
        if made == "workspaces":
            (layout.data_dir / made).mkdir()
        else:
            (layout.data_dir / made).write_text("x")
        assert instance.resolve(layout, None) == "default", made
        assert instance.resolve(layout, None) == "default"
    # --instance wins for its run; a new data folder keeps it, a kept id stays as it is.
    fresh = Layout(tmp_path / "fresh" / "data", tmp_path / "fresh" / "run")
    assert instance.resolve(fresh, "ci-7") == "ci-7"
    assert instance.resolve(fresh, None) == "ci-7"
    assert instance.resolve(fresh, "other") == "other"
    assert instance.resolve(fresh, None) == "ci-7"


def test_a_file_that_holds_no_id_is_refused_saying_what_to_write(tmp_path):
    layout = Layout(tmp_path / "data", tmp_path / "run")
    layout.data_dir.mkdir()
    (layout.data_dir / "instance").write_text("Not An Id!\n")
    with pytest.raises(ConfigError, match=r"does not hold an instance id .* write the id"):
        instance.resolve(layout, None)


# -- two afe up on one engine ----------------------------------------------------

async def _ticket_state(afe: Afe, ticket_id: str) -> str:
    key = bytes.fromhex((afe.run_dir / "automation.key").read_text().strip())
    async with open_channel(str(afe.run_dir / "scheduler.sock"), key) as ch:
        return state_name(await scheduler_pb2_grpc.SchedulerStub(ch).GetTicket(pb.GetTicketRequest(id=ticket_id)))


@pytest.mark.docker
@pytest.mark.timeout(360)
async def test_a_second_afe_up_in_another_folder_leaves_the_first_ones_running_ticket_alone():
    bases = [temp_root(f"afe-inst{i}-") for i in range(3)]
    for base in bases:
        cfg = demo.materialize(base / "cfg")
        (cfg / "afe.yaml").unlink()
        (cfg / "demo-model.yaml").unlink()
        (cfg / "test.yaml").write_text(CONFIG)
    started: list[Afe] = []
    ids: list[str] = []
    try:
        first = start_afe(bases[0], base_env(), own_instance=False)
        started.append(first)
        await asyncio.to_thread(first.wait_up)
        ids.append((first.data / "instance").read_text().strip())
        assert f"  instance: {ids[0]} " in first.text()
        key = bytes.fromhex((first.run_dir / "automation.key").read_text().strip())
        async with open_channel(str(first.run_dir / "scheduler.sock"), key) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            t = await stub.CreateTicket(pb.CreateTicketRequest(workflow="nap", title="nap"))
            await wait_for_event(stub, t.id,
                                 lambda e: e.type == "node.output" and "napping" in payload(e)["text"])
        assert len(_objects(ids[0], t.id)["containers"]) == 1

        # The user's second `afe up`, in another folder, no --instance: its start reconciles its own.
        second = start_afe(bases[1], base_env(), own_instance=False)
        started.append(second)
        await asyncio.to_thread(second.wait_up)
        ids.append((second.data / "instance").read_text().strip())
        assert len(_objects(ids[0], t.id)["containers"]) == 1, "the second afe removed the first one's sandbox"
        assert await _ticket_state(first, t.id) == "running"
        assert ids[1] != ids[0]

        # Positive control: an afe up with the first one's instance (the old shared default)
        # removes the running ticket's sandbox when it starts.
        third = start_afe(bases[2], base_env(), "--instance", ids[0])
        started.append(third)
        await asyncio.to_thread(third.wait_up)
        for _ in range(50):
            if not _objects(ids[0], t.id)["containers"]:
                break
            await asyncio.sleep(0.2)
        assert _objects(ids[0], t.id)["containers"] == [], "control: a shared instance should have removed it"
        assert third.stop() == 0

        async with open_channel(str(first.run_dir / "scheduler.sock"), key) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            await stub.CancelTicket(pb.CancelTicketRequest(id=t.id, principal="test"))
            await wait_for_state(stub, t.id, {"cancelled", "failed"}, deadline_s=60)
    finally:
        for afe in started:
            afe.stop()
        for inst in ids:
            _cleanup(inst)
        for base in bases:
            remove_temp_root(base)
