"""The real broker process: the launcher's conventions (link fd, status fd,
ops port), serving only the scheduler, secrets taken out of the environment
(R28, R30)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from services._gen.afe.credentials.v1 import credentials_pb2_grpc as pb_grpc
from services.common.layout import Layout
from services.common.rpc import grpcutil
from services.common.rpc.links import LinkSecrets, new_secret, pass_via_pipe

pytestmark = pytest.mark.timeout(90)


async def test_r30_process_serves_the_scheduler_and_drops_secrets_from_its_environment(short_tmp, local_origin):
    config_dir = short_tmp / "config"
    config_dir.mkdir()
    (config_dir / "afe.yaml").write_text(
        f"kind: Workspace\nname: local\nrepo: {local_origin}\nbaseBranch: main\nforge: {{type: local}}\n---\n"
        "kind: Model\nname: gpt\nprovider: openai\nmodel: m\nbaseUrl: http://127.0.0.1:9/v1\n"
        "apiKeyEnv: AFE_TEST_MODEL_KEY\n")
    key_value = "modelkey-" + os.urandom(12).hex()
    layout = Layout(short_tmp / "data", short_tmp / "run")
    scheduler, other = new_secret(), new_secret()
    link_fd = pass_via_pipe(LinkSecrets(serve={"scheduler": scheduler}).to_json())
    status_r, status_w = os.pipe()
    os.set_inheritable(status_w, True)
    env = {**os.environ, "AFE_TEST_MODEL_KEY": key_value}
    proc = subprocess.Popen(  # noqa: ASYNC220 -- started once, waited on in a thread
        [sys.executable, "-m", "services.credentials.main", "--config", str(config_dir),
         "--data", str(layout.data_dir), "--run", str(layout.run_dir), "--link-fd", str(link_fd),
         "--status-fd", str(status_w), "--ops-port", "0"],
        env=env, pass_fds=(link_fd, status_w), cwd=os.getcwd(), stderr=subprocess.PIPE)
    os.close(link_fd)
    os.close(status_w)
    try:
        line = await asyncio.to_thread(lambda: os.fdopen(status_r).readline())
        assert line, proc.stderr.read().decode() if proc.poll() is not None else "no status line"
        ready = json.loads(line)
        assert ready["service"] == "credentials" and ready["pid"] == proc.pid
        # R30: the key is gone from the process environment, even the raw block.
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert key_value.encode() not in environ
        # Positive control: a variable that is not a manifest secret is still there.
        assert b"PATH=" in environ
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{ready['ops_port']}/readyz", timeout=5).read())
        assert body
        sock = str(layout.socket("credentials"))
        assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
        async with grpcutil.open_channel(sock, other) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.CredentialBrokerStub(ch).PrepareWorkspace(
                    pb.PrepareWorkspaceRequest(ticket_id="tkt-zq7x", workspace="local"))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        async with grpcutil.open_channel(sock, scheduler) as ch:
            stub = pb_grpc.CredentialBrokerStub(ch)
            prep = await stub.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id="tkt-zq7x", workspace="local"))
            assert len(prep.base_sha) == 40 and prep.branch == "afe/tkt-zq7x"
            with pytest.raises(grpc.aio.AioRpcError) as info:  # nothing listens on :9
                await stub.Complete(pb.CompleteRequest(model="gpt", messages=[pb.Message(role="user", content="x")]))
            assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            assert key_value not in info.value.details()
        metrics = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{ready['ops_port']}/metrics", timeout=5).read())
        assert b'afe_git_operations_total{op="checkout",outcome="ok"} 1.0' in metrics
        assert b"zq7x" not in metrics and key_value.encode() not in metrics   # R25
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = await asyncio.to_thread(proc.wait, 20)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    err = proc.stderr.read().decode()
    assert rc == 0, err
    assert key_value not in err
