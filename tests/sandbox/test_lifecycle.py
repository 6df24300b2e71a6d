"""Sandbox lifecycle: idempotent create, list, destroy, reconcile limited to
the broker's own instance, workspace ownership, and the real broker process
(`python -m services.sandbox.main`) killed with SIGKILL then reconciled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.common.layout import SANDBOX_UID, Layout
from services.common.rpc.links import LinkSecrets, new_secret, pass_via_pipe
from services.sandbox.files.diskcap import DiskCaps
from services.sandbox.files.tools import FileTools
from tests.sandbox.conftest import run, spec_runtime, sync_stub
from tests.support.sandbox_broker import new_instance

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]

CONFIG = """kind: Workspace
name: w
repo: {repo}
---
kind: Agent
name: coder
type: acp
command: [coder-agent, --acp]
env: [AGENT_TOKEN]
---
kind: Workflow
name: wf
workspace: w
nodes:
  - id: code
    agent: coder
    prompt: "do it"
"""


def test_create_is_idempotent_and_listed(stub):
    ticket = "idem-" + new_instance("i")
    try:
        a = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket))
        b = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket))
        assert a.container_id == b.container_id and b.state == "running"
        listed = [s for s in stub.ListSandboxes(pb.ListSandboxesRequest()).sandboxes if s.ticket_id == ticket]
        assert len(listed) == 1 and listed[0].container_id == a.container_id
    finally:
        assert stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket)).removed == 1
    assert ticket not in [s.ticket_id for s in stub.ListSandboxes(pb.ListSandboxesRequest()).sandboxes]


def test_bad_ticket_id_and_limits_are_refused(stub):
    import grpc
    for req in (pb.CreateSandboxRequest(ticket_id="Bad/../id"),
                pb.CreateSandboxRequest(ticket_id="ok-id", spec=pb.SandboxSpec(limits=pb.Limits(pids=-1))),
                pb.CreateSandboxRequest(ticket_id="ok-id", spec=pb.SandboxSpec(egress=["10.0.0.1"]))):
        with pytest.raises(grpc.RpcError) as ei:
            stub.CreateSandbox(req)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_workspace_files_written_by_sandbox_are_usable_by_host_tools_and_git(stub, broker, plain_sandbox):
    run(stub, plain_sandbox, "mkdir -p own && echo from-sandbox > own/s.txt")
    ws = broker.layout.workspace(plain_sandbox)
    assert os.stat(ws / "own" / "s.txt").st_uid == SANDBOX_UID
    tools = FileTools(broker.layout.workspace)
    assert tools.read(plain_sandbox, "own/s.txt")[0] == b"from-sandbox\n"
    tools.write(plain_sandbox, "own/h.txt", b"from-host")
    assert os.stat(ws / "own" / "h.txt").st_uid == SANDBOX_UID       # the sandbox can change it
    assert run(stub, plain_sandbox, "echo more >> own/h.txt && cat own/h.txt").stdout == b"from-hostmore\n"
    env = {**os.environ, "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}
    git = ["git", "-c", f"safe.directory={ws}", "-C", str(ws)]
    subprocess.run([*git, "init", "-q"], check=True, env=env)
    subprocess.run([*git, "add", "own"], check=True, env=env)
    subprocess.run([*git, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"], check=True, env=env)


def test_reconcile_removes_only_dead_tickets_of_its_own_instance(stub, broker, docker_client, runtime):
    live, dead = "live-" + new_instance("r"), "dead-" + new_instance("r")
    other = docker_client.containers.run("afe/sandbox:latest", ["sleep", "infinity"], detach=True,
                                         labels={"afe.ticket": dead, "afe.instance": broker.instance + "x",
                                                 "afe.role": "sandbox"})
    try:
        stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=live))
        stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=dead, spec=pb.SandboxSpec(
            egress=["x.invalid"], runtime=spec_runtime(runtime))))
        egress_dir = broker.layout.run_dir / "egress" / dead
        assert egress_dir.is_dir() == (runtime == "gvisor")       # the proxy's socket folder (gVisor)
        keep = [s.ticket_id for s in stub.ListSandboxes(pb.ListSandboxesRequest()).sandboxes if s.ticket_id != dead]
        r = stub.Reconcile(pb.ReconcileRequest(live_tickets=keep))
        assert list(r.removed_tickets) == [dead] and r.removed_containers == 2
        assert r.removed_networks == (1 if runtime == "runc" else 0) and not egress_dir.exists()
        names = [s.ticket_id for s in stub.ListSandboxes(pb.ListSandboxesRequest()).sandboxes]
        assert live in names and dead not in names
        other.reload()
        assert other.status == "running"           # another instance's object is untouched
    finally:
        other.remove(force=True)
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=live))


def _start_broker_process(tmp: Path, instance: str, env_extra: dict) -> tuple[subprocess.Popen, str, bytes, int]:
    (tmp / "cfg").mkdir()
    (tmp / "cfg" / "afe.yaml").write_text(CONFIG.format(repo=tmp / "repo.git"))
    secret = new_secret()
    link_fd = pass_via_pipe(LinkSecrets(serve={"scheduler": secret}).to_json())
    status_r, status_w = os.pipe()
    os.set_inheritable(status_w, True)
    layout = Layout(tmp / "data", tmp / "run")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp), **env_extra}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.sandbox.main", "--config", str(tmp / "cfg"), "--data", str(layout.data_dir),
         "--run", str(layout.run_dir), "--link-fd", str(link_fd), "--status-fd", str(status_w),
         "--ops-port", "0", "--instance", instance],
        cwd=REPO, env=env, pass_fds=(link_fd, status_w))
    os.close(link_fd)
    os.close(status_w)
    with os.fdopen(status_r) as f:
        line = f.readline()
    assert line, "the broker exited before reporting ready"
    status = json.loads(line)
    assert status["service"] == "sandbox"
    return proc, str(layout.socket("sandbox")), secret, status["ops_port"]


def test_reconcile_after_broker_sigkill(tmp_path, docker_client):
    instance = new_instance("k")
    tmp = Path(f"/tmp/afe-k-{instance}")
    tmp.mkdir()
    token = "agent-token-" + new_instance("v")
    proc, sock, secret, ops_port = _start_broker_process(tmp, instance, {"AGENT_TOKEN": token})
    try:
        # R30: the broker read the declared value and removed it from its environ
        assert token.encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes()
        ch, stub = sync_stub(sock, secret)
        for t in ("k1", "k2"):
            stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=t, spec=pb.SandboxSpec(
                egress=["x.invalid"] if t == "k2" else [], env_names=["AGENT_TOKEN"])))
        out = b"".join(o.stdout for o in stub.Process(iter([pb.ProcessInput(start=pb.ProcessStart(
            ticket_id="k1", argv=["printenv", "AGENT_TOKEN"], env_names=["AGENT_TOKEN"]))]), timeout=60))
        assert out.strip() == token.encode()
        ch.close()
        # ops: ready names the docker check; metrics count creations without any ticket id (R25)
        with urllib.request.urlopen(f"http://127.0.0.1:{ops_port}/readyz", timeout=10) as r:
            assert r.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{ops_port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert 'afe_sandbox_create_seconds_count{egress="allowlist"} 1.0' in metrics
        assert 'afe_sandbox_create_seconds_count{egress="none"} 1.0' in metrics
        assert "k1" not in metrics and "k2" not in metrics and token not in metrics
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        flt = {"label": [f"afe.instance={instance}"]}
        assert len(docker_client.containers.list(all=True, filters=flt)) == 3   # left behind
        # a new broker of the same instance reconciles them away
        (tmp / "2").mkdir()
        proc, sock, secret, _ = _start_broker_process(tmp / "2", instance, {})
        ch, stub = sync_stub(sock, secret)
        r = stub.Reconcile(pb.ReconcileRequest(live_tickets=[]))
        ch.close()
        assert sorted(r.removed_tickets) == ["k1", "k2"] and r.removed_containers == 3 and r.removed_networks == 1
        assert docker_client.containers.list(all=True, filters=flt) == []
        assert docker_client.networks.list(filters=flt) == []
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(20)
        for c in docker_client.containers.list(all=True, filters={"label": [f"afe.instance={instance}"]}):
            c.remove(force=True)
        for n in docker_client.networks.list(filters={"label": [f"afe.instance={instance}"]}):
            n.remove()
        # R34: the killed broker's workspace disk images are in its own data folder, not the second's
        first = Layout(tmp / "data", tmp / "run")
        DiskCaps(first.workspaces_dir).reconcile([], first.workspace)
        subprocess.run(["rm", "-rf", str(tmp)], check=False)


def test_host_written_files_are_given_to_the_sandbox_on_create(stub, broker, plain_sandbox, broker_root):
    ws = broker.layout.workspace(plain_sandbox)
    (ws / "hostdir").mkdir(exist_ok=True)
    (ws / "hostdir" / "root-owned.txt").write_text("x")     # as a root clone would leave it
    outside = broker_root / "not-yours.txt"
    outside.write_text("keep")
    os.symlink(outside, ws / "hostdir" / "link-out")
    assert run(stub, plain_sandbox, "echo y >> hostdir/root-owned.txt && echo ok").stdout.strip() != b"ok"  # control
    stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=plain_sandbox))      # idempotent create fixes ownership
    assert run(stub, plain_sandbox, "echo y >> hostdir/root-owned.txt && echo ok").stdout.strip() == b"ok"
    assert os.stat(outside).st_uid == 0                      # the link's target was not chowned


def test_proxy_readiness_is_probed_from_inside_when_the_host_cannot_route(monkeypatch, broker_root):
    import asyncio

    from services.sandbox.containers.hardening import SandboxSettings
    from services.sandbox.sandboxes import SandboxManager

    tried = []

    async def unreachable(host, port, *a, **kw):
        tried.append(host)
        raise OSError(113, "No route to host")

    async def body():
        root = broker_root / "route"
        mgr = SandboxManager(Layout(root / "data", root / "run"), instance=new_instance("route"))
        try:
            info = await mgr.create(SandboxSettings(ticket_id="route", egress=("x.invalid",)))
            return mgr.client.containers.get(info.proxy_container_id).exec_run(
                ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/3128 && echo listening"]).output
        finally:
            await mgr.reconcile([])
    monkeypatch.setattr(asyncio, "open_connection", unreachable)
    assert asyncio.run(body()).strip() == b"listening" and tried


def test_create_restarts_a_stopped_sandbox_and_its_proxy(stub, docker_client):
    ticket = "restart-" + new_instance("s")
    try:
        sb = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(egress=["x.invalid"])))
        for cid in (sb.container_id, sb.proxy_container_id):
            docker_client.containers.get(cid).stop(timeout=1)       # as after an engine restart
        import grpc
        with pytest.raises(grpc.RpcError) as ei:
            run(stub, ticket, "true")
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        again = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket))
        assert again.container_id == sb.container_id and again.state == "running"
        assert docker_client.containers.get(sb.proxy_container_id).status == "running"
        assert "403" in run(stub, ticket, "python3 -c \"import urllib.request as u\ntry: u.urlopen('http://y.invalid/')\n"
                                          "except Exception as e: print(e)\"").stdout.decode()
    finally:
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))


def test_create_thaws_a_sandbox_left_frozen_so_a_command_runs(stub, docker_client):
    """A scheduler that stopped mid-step (Freeze, then `afe up` ended) leaves its sandbox
    paused, and a command in a frozen sandbox would wait for ever; the next create thaws it.
    (Control: the sandbox is paused before that create -- nothing else thawed it.)"""
    ticket = "thaw-" + new_instance("s")
    try:
        sb = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket))
        stub.Freeze(pb.FreezeRequest(ticket_id=ticket, frozen=True))
        assert docker_client.containers.get(sb.container_id).attrs["State"]["Paused"]
        again = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket))
        assert again.container_id == sb.container_id and again.state == "running"
        assert not docker_client.containers.get(sb.container_id).attrs["State"]["Paused"]
        assert run(stub, ticket, "echo thawed").stdout == b"thawed\n"
    finally:
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))


def test_a_freeze_right_after_create_lands_after_the_supervisors_start(stub, docker_client):
    """The broker starts a new sandbox's command supervisor (one exec) as the
    create returns, and a Freeze at once could pause the container under that
    exec's start and hang it for good (seen once in a loaded run of the test
    above; tests/sandbox/containers/test_exec_starts.py reproduces the race at
    the engine and holds the control). Each round must freeze, thaw and run a
    command in time."""
    for i in range(5):
        ticket = f"fz{i}-" + new_instance("f")
        try:
            sb = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket), timeout=120)
            stub.Freeze(pb.FreezeRequest(ticket_id=ticket, frozen=True), timeout=60)
            stub.Freeze(pb.FreezeRequest(ticket_id=ticket, frozen=False), timeout=60)
            assert not docker_client.containers.get(sb.container_id).attrs["State"]["Paused"]
            assert run(stub, ticket, "echo alive").stdout == b"alive\n"
        finally:
            stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket), timeout=120)
