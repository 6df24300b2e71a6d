"""Ops endpoints: bound to 127.0.0.1 unless --ops-host (R23); readiness names
the failing dependency, never its error text (R24)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from services.common.observability.ops import OpsServer

from .procnet import listeners

CANARY = "canary-R24-7f3a9c1e-secret-error-text"


async def _ok() -> bool:
    return True


async def _boom() -> bool:
    raise ConnectionError(f"cannot reach postgres://app:{CANARY}@db/afe")


async def _get(port: int, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}{path}") as r:
        return r.status, await r.text()


async def test_r24_readyz_names_failing_dependency_without_its_error_text(caplog):
    # Positive control: the failing check really carries the canary in its error.
    with pytest.raises(ConnectionError, match=CANARY):
        await _boom()
    ops = OpsServer(CollectorRegistry(), {"store": _boom, "docker": _ok})
    port = await ops.start()
    try:
        status, body = await _get(port, "/readyz")
        live, _ = await _get(port, "/livez")
    finally:
        await ops.stop()
    assert status == 503
    assert json.loads(body) == {"status": "unavailable", "failing": ["store"]}
    assert CANARY not in body
    assert live == 200


async def test_readyz_ok_when_every_dependency_is_ready():
    ops = OpsServer(CollectorRegistry(), {"store": _ok, "docker": _ok})
    port = await ops.start()
    try:
        status, body = await _get(port, "/readyz")
        mstatus, _metrics = await _get(port, "/metrics")
    finally:
        await ops.stop()
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert mstatus == 200


async def test_r23_ops_binds_loopback_by_default_and_ops_host_changes_it():
    ops = OpsServer(CollectorRegistry(), {})
    port = await ops.start()
    try:
        assert listeners(port) == {"127.0.0.1"}
    finally:
        await ops.stop()
    # Positive control: with another host the same server listens on all interfaces.
    wide = OpsServer(CollectorRegistry(), {}, host="0.0.0.0")
    port = await wide.start()
    try:
        assert listeners(port) == {"0.0.0.0"}
    finally:
        await wide.stop()


@pytest.mark.timeout(60)
def test_r24_real_process_readyz_hides_dependency_error(short_tmp):
    """A real gateway whose scheduler is missing: 503 naming `scheduler`, and the
    canary (in the scheduler socket path the failing connection reports) absent."""
    run_dir = short_tmp / f"run-{CANARY[:20]}"
    data = short_tmp / "data"
    config = short_tmp / "cfg"
    config.mkdir()
    (config / "afe.yaml").write_text("kind: Workspace\nname: w\nrepo: /nonexistent.git\n")
    # Port 0: the kernel picks a free port and the status line reports it, so a
    # test running in parallel cannot take the port between a probe and the bind.
    r, w = os.pipe()
    env = {"PATH": os.environ["PATH"], "AFE_UI_TOKEN": "t" * 24}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.main", "--config", str(config), "--data", str(data),
         "--run", str(run_dir), "--status-fd", str(w), "--ops-port", "0", "--listen", "127.0.0.1:0"],
        env=env, pass_fds=(w,), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as status:
            line = status.readline()
        assert line, f"the gateway exited before reporting ready: {proc.communicate(timeout=15)[0]!r}"
        port = json.loads(line)["ops_port"]
        assert port > 0
        assert listeners(port) == {"127.0.0.1"}
        import urllib.error
        import urllib.request

        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10)
        body = info.value.read().decode()
        assert info.value.code == 503
        assert json.loads(body)["failing"] == ["scheduler"]
        assert CANARY[:20] not in body
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0, out.decode()[-2000:]
