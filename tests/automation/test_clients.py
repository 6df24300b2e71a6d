"""Clients of the automation socket against a real `afe up` on the bundled
demo: the Python example (examples/automation_client.py, generated stubs) and
an unmodified third-party client in another language (Node: @grpc/grpc-js +
@grpc/proto-loader loading afe's .proto), each creating, watching and
approving a ticket that then merges."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc as rpc
from services.common.rpc.grpcutil import open_channel
from tests.foundation.launcher_support import Afe, base_env, wait_gone
from tests.support.npm import node_modules
from tests.support.temp_roots import remove_temp_root, temp_root

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = Path(__file__).resolve().parent / "node"


class Demo:
    def __init__(self, afe: Afe) -> None:
        self.afe = afe
        self.run_dir = afe.base / "run"
        self.repo = afe.base / "demo" / "repos" / "calc.git"
        self.initial_main = self._git("rev-parse", "refs/heads/main")

    def _git(self, *args: str) -> str:
        return subprocess.run(["git", "--git-dir", str(self.repo), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    def reset(self) -> None:
        """main back on the demo's first commit (the bug present), so each client sees the same change."""
        self._git("update-ref", "refs/heads/main", self.initial_main)

    async def _until_finished(self, ticket_id: str) -> pb.Ticket:
        key = bytes.fromhex((self.run_dir / "automation.key").read_text().strip())
        async with open_channel(str(self.run_dir / "scheduler.sock"), key) as ch:
            stub = rpc.SchedulerStub(ch)
            async for _ in stub.WatchTicket(pb.WatchTicketRequest(id=ticket_id, from_seq=1, follow=True)):
                pass
            return await stub.GetTicket(pb.GetTicketRequest(id=ticket_id))

    def finished(self, ticket_id: str) -> pb.Ticket:
        return asyncio.run(self._until_finished(ticket_id))


@pytest.fixture(scope="module")
def demo():
    base = temp_root("afe-auto-")
    instance = f"auto-{secrets.token_hex(3)}"
    # No --config: `afe up` runs the bundled demo.
    proc = subprocess.Popen([sys.executable, "-m", "services.cli.main", "up", "--data", str(base / ".afe/data"),
                             "--ops-port", "0", "--listen", "127.0.0.1:0", "--instance", instance],
                            cwd=base, env={**base_env(), "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    afe = Afe(base / ".afe", proc)

    def pump() -> None:
        for line in iter(proc.stdout.readline, b""):
            afe.output.append(line.decode("utf-8", "replace"))

    threading.Thread(target=pump, daemon=True).start()
    try:
        afe.wait_up()
        yield Demo(afe)
    finally:
        pids = list(afe.pids().values())
        code = afe.stop()
        assert wait_gone(pids, 10) == []
        remove_temp_root(base)
        assert code == 0, afe.text()[-3000:]


def test_python_example_client_creates_follows_diffs_and_approves_the_sha_it_saw(demo):
    demo.reset()
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "automation_client.py"),
                          "--run", str(demo.run_dir), "--principal", "example-test"],
                         cwd=demo.afe.base, capture_output=True, text=True, check=False, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    tid = lines[0].removeprefix("created ")
    assert any(" approval.requested" in line for line in lines), out.stdout
    assert "+    return a + b" in out.stdout                    # the diff was printed
    approved = [line for line in lines if line.startswith(f"approved {tid} at ")]
    assert approved, out.stdout
    sha = approved[0].split(" at ")[1].split()[0]
    final = demo.finished(tid)
    assert pb.TicketState.Name(final.state) == "TICKET_STATE_SUCCEEDED", final
    assert final.approval.sha == sha and final.approval.principal == "example-test"
    assert final.pr.state == "merged"


def _node_modules() -> Path:
    """`npm ci` of the committed lock file, once per lock-file content (tests/support/npm.py)."""
    return node_modules(NODE_DIR, "@grpc/grpc-js/package.json")


@pytest.mark.skipif(not (shutil.which("node") and shutil.which("npm")),
                    reason="node and npm are not installed (.ci/run installs Debian's nodejs and npm)")
def test_node_grpc_js_client_creates_watches_and_approves_through_the_same_socket(demo):
    modules = _node_modules()
    demo.reset()
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "NODE_PATH": str(modules)}
    out = subprocess.run(["node", str(NODE_DIR / "client.js"), "--run", str(demo.run_dir),
                          "--proto", str(ROOT / "proto")],
                         cwd=demo.afe.base, env=env, capture_output=True, text=True, check=False, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["state"] == "TICKET_STATE_SUCCEEDED", result
    assert result["approved_sha"] and result["approval_sha"] == result["approved_sha"]
    assert result["pr_state"] == "merged"
    # Watched across two streams (stopped at approval.requested, resumed after approving): every seq once.
    assert result["seqs"] == list(range(1, result["last_seq"] + 1))
    final = demo.finished(result["id"])
    assert final.approval.principal == "node-client" and final.approval.sha == result["approved_sha"]
