"""Ctrl-C during a ticket (issue 35): `afe up` stops its four processes and says
what it keeps on purpose and how to remove it.

A ticket whose `run:` node sleeps when SIGINT reaches the launcher keeps its
sandbox, its egress proxy and network, and (mount mode, R34) its workspace's
loop-mounted disk, so the next `afe up` resumes it where it stopped. The
launcher names each of them under the ticket's id, and the advice it prints
works: after a restart, `afe ticket cancel ID` (the real CLI) removes every
one, and that stop says nothing more.

Positive control: the objects the message names are really there after the
stop (Docker and the mount table agree with it) — what used to be left
without a word.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import signal
import subprocess
import sys

import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc
from services.common import demo
from services.common.rpc.grpcutil import open_channel
from services.sandbox.files import diskcap
from tests.scheduler.conftest import payload, state_name, wait_for_event, wait_for_state
from tests.support.temp_roots import disk_caps_left, remove_temp_root, temp_root

from .launcher_support import ROOT, base_env, start_afe
from .test_r12_crash_teardown import _cleanup, _objects

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

CONFIG = """\
kind: Workspace
name: calc
repo: repos/calc.git
forge: {type: local}
sandbox:
  egress: [pypi.org]
---
kind: Workflow
name: nap
workspace: calc
nodes:
  - {id: nap, run: "echo napping && sleep 120", timeout: 300}
"""


def _names(kind: str, ids: list[str]) -> set[str]:
    if not ids:
        return set()
    r = subprocess.run(["docker", kind, "inspect", "--format", "{{.Name}}", *ids], capture_output=True,
                       text=True, check=True)
    return {n.strip().lstrip("/") for n in r.stdout.split()}


async def test_ctrl_c_mid_ticket_says_what_is_kept_and_how_to_remove_it():
    base = temp_root("afe-cc-")
    cfg = demo.materialize(base / "cfg")
    (cfg / "afe.yaml").unlink()
    (cfg / "demo-model.yaml").unlink()
    (cfg / "test.yaml").write_text(CONFIG)
    instance = f"cc-{secrets.token_hex(4)}"
    running = start_afe(base, base_env(), "--instance", instance)
    again = None
    try:
        await asyncio.to_thread(running.wait_up)
        key = bytes.fromhex((running.run_dir / "automation.key").read_text().strip())
        async with open_channel(str(running.run_dir / "scheduler.sock"), key) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            t = await stub.CreateTicket(pb.CreateTicketRequest(workflow="nap", title="nap"))
            await wait_for_event(stub, t.id,
                                 lambda e: e.type == "node.output" and "napping" in payload(e)["text"])

        running.proc.send_signal(signal.SIGINT)          # what Ctrl-C in the terminal sends
        assert await asyncio.to_thread(running.proc.wait, 30) == 0
        text = running.text()
        assert "afe up: stopping (SIGINT)" in text

        # Positive control: the ticket's objects are still there.
        left = _objects(instance, t.id)
        assert len(left["containers"]) == 2 and len(left["networks"]) == 1, left
        workspace = running.data / "workspaces" / t.id
        mounted = diskcap.detect_mode()[0] == diskcap.MODE_MOUNT
        if mounted:
            caps = disk_caps_left([base])
            assert any(c.startswith(f"mount {workspace} ") for c in caps), caps

        # ... and the launcher named every one of them, why they are kept, and how to remove them.
        assert "kept on purpose for the tickets still running, so the next `afe up`" in text, text[-3000:]
        line = next(ln for ln in text.splitlines() if ln.startswith(f"  {t.id}: "))
        sandbox, proxy = sorted(_names("container", left["containers"]), key=len)
        (network,) = _names("network", left["networks"])
        assert f"sandbox {sandbox}, egress proxy {proxy}, network {network}" in line, line
        assert (f"workspace disk mounted on {workspace}" in line) == mounted, line
        assert "start `afe up` again and run `afe ticket cancel ID` for each ticket above" in text

        # The advice works: start again, cancel with the CLI, and everything goes.
        again = start_afe(base, base_env(), "--instance", instance)
        await asyncio.to_thread(again.wait_up)
        url = re.search(r"afe is up: open (\S+)", again.text()).group(1).rstrip("/")
        r = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "services.cli.main", "ticket", "cancel", t.id, "--json",
                             "--data", str(again.data)],
            cwd=ROOT, env=base_env(AFE_URL=url), capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["id"] == t.id, r.stdout
        key = bytes.fromhex((again.run_dir / "automation.key").read_text().strip())
        async with open_channel(str(again.run_dir / "scheduler.sock"), key) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            done = await wait_for_state(stub, t.id, {"failed", "succeeded", "cancelled"}, deadline_s=60)
            assert state_name(done) == "cancelled", done.error
        for _ in range(100):
            if _objects(instance) == {"containers": [], "networks": []} and disk_caps_left([base]) == []:
                break
            await asyncio.sleep(0.2)
        assert _objects(instance) == {"containers": [], "networks": []}
        assert disk_caps_left([base]) == []
        before = len(again.output)
        assert again.stop() == 0
        after = "".join(again.output[before:])
        assert "kept on purpose" not in after and "warm sandbox" not in after, after
    finally:
        running.stop()
        if again is not None:
            again.stop()
        _cleanup(instance)
        remove_temp_root(base)


def test_the_report_groups_by_ticket_and_tells_warm_sandboxes_apart(tmp_path, monkeypatch):
    """Without Docker: a clean-room verification's sandbox (`<ticket>-verify`) is its
    ticket's; a reserved id the scheduler's pool marked is a warm sandbox, not a ticket."""
    from services.common.layout import Layout
    from services.launcher import kept

    layout = Layout(tmp_path / "data", tmp_path / "run")
    (layout.data_dir / "pool").mkdir(parents=True)
    (layout.data_dir / "pool" / "t-000000000002").write_text("calc")
    rows = {"ps": [["t-000000000001", "sandbox", "afe-x-t-000000000001"],
                   ["t-000000000001-verify", "sandbox", "afe-x-t-000000000001-verify"],
                   ["t-000000000002", "sandbox", "afe-x-t-000000000002"]],
            "network": [["t-000000000001", "afe-x-t-000000000001"]]}
    monkeypatch.setattr(kept, "_docker_lines", lambda argv, environ: rows[argv[0]])
    monkeypatch.setattr(kept, "_mount_points", lambda under: [under / "t-000000000001"])
    lines: list[str] = []
    kept.report(layout, "x", {}, lines.append)
    (ticket,) = [ln for ln in lines if ln.startswith("  t-")]
    assert ticket == ("  t-000000000001: sandbox afe-x-t-000000000001, sandbox afe-x-t-000000000001-verify, "
                      "network afe-x-t-000000000001, "
                      f"workspace disk mounted on {layout.workspaces_dir}/t-000000000001")
    assert lines[-1] == ("afe up: 1 warm sandbox(es) not given to any ticket yet (t-000000000002): "
                         "the next `afe up` removes them")

    # Control: nothing kept, nothing said.
    rows = {"ps": [], "network": []}
    monkeypatch.setattr(kept, "_mount_points", lambda under: [])
    lines.clear()
    kept.report(layout, "x", {}, lines.append)
    assert lines == []
