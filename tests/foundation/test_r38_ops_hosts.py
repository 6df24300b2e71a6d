"""R38 on the ops ports (/livez /readyz /metrics): a request must name the
server in its Host header — the bound address, `localhost` when bound to
loopback (or to every address), any IP literal when bound to every address,
or a name given with `--ops-name` — or it gets 421 (DNS rebinding: a page on
evil.example whose name now resolves to 127.0.0.1 sends `Host: evil.example`).

Positive control in every case: the same request with an accepted Host is
served."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from services.common.observability.ops import HostPolicy, OpsServer, check_ops_name
from tests.support.temp_roots import remove_temp_root, temp_root

from .launcher_support import CANARIES, SERVICES, base_env, start_afe

PATHS = ("/livez", "/readyz", "/metrics")
REBINDING = ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example:{port}", "localhost.evil.example",
             "127.0.0.1:{port}@evil.example", "[::1", ""]

# (bind, extra names, host header, accepted)
CASES = [
    ("127.0.0.1", (), "127.0.0.1:9100", True),
    ("127.0.0.1", (), "127.0.0.1", True),
    ("127.0.0.1", (), "localhost:9100", True),
    ("127.0.0.1", (), "LOCALHOST.", True),
    ("127.0.0.1", (), "evil.example", False),
    ("127.0.0.1", (), "evil.example:9100", False),
    ("127.0.0.1", (), "10.0.0.5:9100", False),
    ("127.0.0.1", (), "[::1]:9100", False),
    ("127.0.0.1", (), "127.0.0.1:91x", False),
    ("127.0.0.1", (), "127.0.0.1:9100:1", False),
    ("127.0.0.1", (), None, False),
    ("127.0.0.1", ("ops.internal",), "ops.internal:9100", True),
    ("127.0.0.1", ("ops.internal",), "x.ops.internal:9100", False),
    ("::1", (), "[::1]:9100", True),
    ("::1", (), "[0:0::1]", True),
    ("::1", (), "::1", False),
    ("::1", (), "localhost", True),
    ("10.1.2.3", (), "10.1.2.3:9100", True),
    ("10.1.2.3", (), "localhost:9100", False),
    ("10.1.2.3", ("metrics.corp",), "metrics.corp", True),
    ("0.0.0.0", (), "192.168.7.7:9100", True),
    ("0.0.0.0", (), "[fe80::1]:9100", True),
    ("0.0.0.0", (), "localhost", True),
    ("0.0.0.0", (), "evil.example", False),
    ("::", (), "evil.example:9100", False),
]


@pytest.mark.parametrize(("bind", "names", "host", "accepted"), CASES)
def test_r38_host_policy_table(bind, names, host, accepted):
    assert HostPolicy(bind, names).allows(host) is accepted


@pytest.mark.parametrize("bad", ["", "evil example", "a/b", "x" * 300, "-lead.example"])
def test_r38_ops_name_must_be_a_host_name(bad):
    with pytest.raises(ValueError, match="--ops-name"):
        check_ops_name(bad)


async def _statuses(port: int, host: str) -> dict[str, int]:
    out = {}
    async with aiohttp.ClientSession() as s:
        for path in PATHS:
            headers = {"Host": host} if host else {"Host": ""}
            async with s.get(f"http://127.0.0.1:{port}{path}", headers=headers) as r:
                await r.read()
                out[path] = r.status
    return out


async def _ok() -> bool:
    return True


async def test_r38_ops_server_refuses_rebinding_hosts_on_every_endpoint():
    ops = OpsServer(CollectorRegistry(), {"store": _ok}, names=("ops.internal",))
    port = await ops.start()
    try:
        for good in (f"127.0.0.1:{port}", "localhost", f"ops.internal:{port}"):
            assert await _statuses(port, good) == dict.fromkeys(PATHS, 200), good
        for host in REBINDING:
            got = await _statuses(port, host.format(port=port))
            assert set(got.values()) <= {400, 421}, (host, got)
    finally:
        await ops.stop()


@pytest.mark.docker
@pytest.mark.timeout(240)
async def test_r38_every_process_ops_port_refuses_a_rebinding_host():
    """The four real processes of `afe up`, one of them given --ops-name."""
    base = temp_root("afe-r38-")
    running = start_afe(base, base_env(**CANARIES), "--ops-name", "ops.internal")
    try:
        st = await asyncio.to_thread(running.wait_up)
        for service in SERVICES:
            port = st["children"][service]["ops_port"]
            for good in (f"127.0.0.1:{port}", f"localhost:{port}", "ops.internal"):   # control
                got = await _statuses(port, good)
                assert got["/livez"] == 200 and got["/metrics"] == 200, (service, good, got)
                assert got["/readyz"] in (200, 503), (service, good, got)
            for host in REBINDING:
                got = await _statuses(port, host.format(port=port))
                assert set(got.values()) <= {400, 421}, (service, host, got)
    finally:
        assert running.stop() == 0, running.text()[-3000:]
        remove_temp_root(base)
