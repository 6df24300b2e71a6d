"""Operator-level private egress (R11): a Workspace's `sandbox.egressPrivate`
lets named private hosts or subnets through the ticket's proxy; everything
else private stays refused. Real squid, real broker, a target server on a
network this module creates (never an address we did not make).

This module's broker exempts NO subnet (unlike the shared one in
conftest.py), so the refusal by default is real; the positive control is the
same fetch with the entry listed, and the target answering from the proxy
container itself."""

from __future__ import annotations

import time

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.cli.doctor import TARGET_SERVER
from services.common.errors import InvalidArgument
from services.common.host.images import SANDBOX_IMAGE
from services.common.layout import Layout
from services.sandbox.egress.allowlist import check_private, squid_conf
from tests.sandbox.conftest import BrokerThread, run, sync_stub
from tests.sandbox.egress.test_egress import FETCH, in_proxy
from tests.support.sandbox_broker import new_instance
from tests.support.temp_roots import remove_temp_root, temp_root

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def private_net(docker_client):
    """A network of our own with one server known as mirror-<i> and other-<i>."""
    inst = new_instance("pv")
    net = docker_client.networks.create(f"afe-test-{inst}", labels={"afe.instance": inst})
    net.reload()
    subnet = net.attrs["IPAM"]["Config"][0]["Subnet"]
    mirror, other = f"mirror-{inst}", f"other-{inst}"
    api = docker_client.api
    cid = api.create_container(
        SANDBOX_IMAGE, ["python3", "-c", TARGET_SERVER], user="0", name=f"target-{inst}",
        labels={"afe.instance": inst}, host_config=api.create_host_config(network_mode=net.name),
        networking_config=api.create_networking_config(
            {net.name: api.create_endpoint_config(aliases=[mirror, other])}))["Id"]
    tgt = docker_client.containers.get(cid)
    try:
        tgt.start()
        for _ in range(100):
            if b"ready" in tgt.logs():
                break
            time.sleep(0.1)
        yield {"network": net.name, "subnet": subnet, "mirror": mirror, "other": other}
    finally:
        tgt.remove(force=True)
        net.remove()


@pytest.fixture(scope="module")
def private_stub(private_net):
    """A broker whose proxies join the test network and that exempts nothing."""
    root = temp_root("afe-sbp-")
    b = BrokerThread(Layout(root / "data", root / "run"), instance=new_instance("pvb"),
                     egress_network=private_net["network"]).start()
    ch, stub = sync_stub(b.socket, b.secret)
    try:
        yield stub
    finally:
        ch.close()
        b.stop()
        remove_temp_root(root)


def sandbox(stub, docker_client, egress: list[str], private: list[str]):
    ticket = "pv-" + new_instance("t")
    sb = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(
        egress=egress, egress_private=private)))
    return ticket, docker_client.containers.get(sb.proxy_container_id)


def fetch(stub, ticket: str, host: str) -> bytes:
    """Through the proxy, whatever the host (the sandbox's own loopback is otherwise not proxied)."""
    script = FETCH.format(url=f"http://{host}/").replace("python3 -", "env NO_PROXY= no_proxy= python3 -")
    return run(stub, ticket, script).stdout.strip()


@pytest.mark.docker
def test_r11_private_target_refused_by_default_and_allowed_when_listed(private_stub, private_net, docker_client):
    m, o = private_net["mirror"], private_net["other"]
    ticket, proxy = sandbox(private_stub, docker_client, [m, o], [])
    try:
        assert fetch(private_stub, ticket, m) == b"HTTP 403"           # private address: refused
        assert in_proxy(proxy, FETCH.format(url=f"http://{m}/")) == "TARGET-OK"   # it does serve
    finally:
        private_stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
    ticket, _ = sandbox(private_stub, docker_client, [m, o], [m])
    try:
        assert fetch(private_stub, ticket, m) == b"TARGET-OK"          # listed: allowed
        assert fetch(private_stub, ticket, o) == b"HTTP 403"           # same server, unlisted name: refused
    finally:
        private_stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))


@pytest.mark.docker
def test_r11_private_subnet_allows_names_in_egress_only_and_never_loopback(private_stub, private_net,
                                                                            docker_client):
    m, o = private_net["mirror"], private_net["other"]
    ticket, _ = sandbox(private_stub, docker_client, [m, "localhost"], [private_net["subnet"], "localhost"])
    try:
        assert fetch(private_stub, ticket, m) == b"TARGET-OK"          # in the listed subnet
        assert fetch(private_stub, ticket, o) == b"HTTP 403"           # in the subnet, but not in egress
        assert fetch(private_stub, ticket, "localhost") == b"HTTP 403"  # loopback: never, even when listed
    finally:
        private_stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))


@pytest.mark.parametrize(("private", "egress", "message"), [
    (["mirror.internal"], ["pypi.org"], "is not in the egress allowlist"),
    (["127.0.0.0/8"], ["pypi.org"], "overlaps loopback"),
    (["0.0.0.0/0"], ["pypi.org"], "overlaps loopback"),
    (["169.254.169.254/32"], ["pypi.org"], "overlaps loopback, link-local"),
    (["fe80::/64"], ["pypi.org"], "overlaps loopback, link-local"),
    (["http://mirror.internal"], ["mirror.internal"], "is not a host name"),
])
def test_r11_broker_refuses_bad_private_entries(private, egress, message):
    with pytest.raises(InvalidArgument, match=message):
        check_private(private, egress)


def test_r11_private_rules_only_with_entries():
    """Defaults stay as today: without entries the config has no private rule."""
    plain = squid_conf(["pypi.org"])
    assert "private" not in plain and "http_access deny blocked_dst\n" in plain
    conf = squid_conf(["mirror.internal", ".corp.example"], private=["mirror.internal", "git.corp.example",
                                                                     "10.20.0.0/16"])
    assert "acl private_names dstdomain -n mirror.internal git.corp.example" in conf
    assert "acl private_dst dst 10.20.0.0/16" in conf
    assert conf.index("http_access deny never_dst") < conf.index("http_access deny blocked_dst !private_names "
                                                                  "!private_dst") < conf.index("http_access allow")
