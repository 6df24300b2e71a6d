"""`afe up` with no --config runs the bundled demo end to end through the four
real processes: a ticket fixes the demo repository, opens a PR on the local
forge, waits for a person's approval (R16), merges, and its sandbox goes away."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import docker
import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc as rpc
from services.common.rpc.grpcutil import open_channel
from tests.support.temp_roots import remove_temp_root, temp_root

from .launcher_support import Afe, base_env, wait_gone

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]



@pytest.fixture
def demo_afe():
    base = temp_root("afe-fnd-demo-")
    instance = f"fnd-demo-{secrets.token_hex(3)}"
    # Started OUTSIDE the source tree with no --config: the bundled demo is used.
    proc = subprocess.Popen([sys.executable, "-m", "services.cli.main", "up", "--data", str(base / ".afe/data"),
                             "--ops-port", "0", "--listen", "127.0.0.1:0", "--instance", instance],
                            cwd=base, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    afe = Afe(base / ".afe", proc)

    def pump() -> None:
        for line in iter(proc.stdout.readline, b""):
            afe.output.append(line.decode("utf-8", "replace"))

    threading.Thread(target=pump, daemon=True).start()
    try:
        afe.wait_up()
        yield afe, instance
    finally:
        pids = list(afe.pids().values())
        code = afe.stop()
        assert wait_gone(pids, 10) == []
        remove_temp_root(base)
        assert code == 0, afe.text()[-3000:]


def _state(t) -> str:
    return pb.TicketState.Name(t.state)


async def _drive(run_dir: Path) -> tuple[object, list[str]]:
    key = bytes.fromhex((run_dir / "automation.key").read_text().strip())
    seen: list[str] = []
    async with open_channel(str(run_dir / "scheduler.sock"), key) as ch:
        stub = rpc.SchedulerStub(ch)
        t = await stub.CreateTicket(pb.CreateTicketRequest(
            workspace="demo", workflow="demo-fix", title="add() subtracts", body="make the tests pass",
            principal="foundation-test"))
        approved = False
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            t = await stub.GetTicket(pb.GetTicketRequest(id=t.id))
            state = _state(t)
            if not seen or seen[-1] != state:
                seen.append(state)
            if "WAITING" in state and not approved:
                assert t.pr.state == "open"        # nothing merged before the approval (R16)
                t = await stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal="foundation-test"))
                approved = True
            if state.endswith(("SUCCEEDED", "FAILED", "CANCELLED")):
                return t, seen
            await asyncio.sleep(0.5)
    raise AssertionError(f"ticket did not finish; states seen: {seen}")


def test_demo_ticket_runs_to_merge_through_afe_up(demo_afe):
    afe, instance = demo_afe
    text = afe.text()
    assert "using the bundled demo" in text
    assert f"login token: in the file {afe.base / 'data' / 'ui-token'}" in text
    ticket, seen = asyncio.run(_drive(afe.base / "run"))
    assert _state(ticket).endswith("SUCCEEDED"), (seen, ticket)
    assert any("WAITING" in s for s in seen), seen
    assert ticket.pr.state == "merged" and ticket.pr.merge_sha
    # The merged fix is on main in the demo repository.
    repo = afe.base / "demo" / "repos" / "calc.git"
    calc = subprocess.run(["git", "--git-dir", str(repo), "show", "main:calc.py"], capture_output=True,
                          text=True, check=True).stdout
    assert "return a + b" in calc
    # The ticket's sandbox is gone once it finished (R12); the demo's warm pool (sandbox.pool: 1)
    # keeps one sandbox of another, reserved id.
    client = docker.from_env()
    mine = {"label": [f"afe.instance={instance}", f"afe.ticket={ticket.id}"]}
    try:
        deadline = time.monotonic() + 30
        while client.containers.list(all=True, filters=mine):
            assert time.monotonic() < deadline, "the finished ticket's containers are still there"
            time.sleep(0.5)
    finally:
        client.close()
    assert json.loads((afe.base / "run" / "launcher.json").read_text())["children"]["gateway"]["ready"]
