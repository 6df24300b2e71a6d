"""Egress (R10-R12) against servers the tests start themselves: a target
container on a test network of our own (never a public host). Positive
controls run the same probe from the proxy container, which sits on the
test network with no ACL in its way, to show the target IS reachable."""

from __future__ import annotations

import ipaddress

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from tests.sandbox.conftest import run, spec_runtime
from tests.support.sandbox_broker import new_instance

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]

FETCH = """python3 - <<'EOF'
import urllib.request, urllib.error, sys
try:
    print(urllib.request.urlopen(sys.argv[1] if len(sys.argv) > 1 else {url!r}, timeout=10).read().decode())
except urllib.error.HTTPError as e:
    print("HTTP", e.code)
except Exception as e:
    print("ERR", type(e).__name__)
EOF"""

CONNECT = """python3 - <<'EOF'
import socket, os
host, port = os.environ["HTTPS_PROXY"].split("//")[1].split(":")
s = socket.create_connection((host, int(port)), timeout=10)
s.sendall(b"CONNECT {dest} HTTP/1.1\\r\\nHost: {dest}\\r\\n\\r\\n")
print(s.recv(200).split(b"\\r\\n")[0].decode())
EOF"""

DIRECT = """python3 - <<'EOF'
import socket
try:
    socket.create_connection(({ip!r}, {port}), timeout=1.5).close()
    print("CONNECTED")
except Exception as e:
    print("ERR", type(e).__name__)
EOF"""


@pytest.fixture(scope="module")
def egress(stub, target_net, docker_client, runtime):
    """An egress sandbox under each runtime: runc on the ticket's internal
    network, gVisor with no interface at all (its proxy through a socket)."""
    ticket = "egress-" + new_instance("a")
    sb = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(
        egress=[target_net["name"], "localhost"], runtime=spec_runtime(runtime))))
    proxy = docker_client.containers.get(sb.proxy_container_id)
    try:
        yield ticket, sb, proxy
    finally:
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))


def in_proxy(proxy, script: str) -> str:
    _code, out = proxy.exec_run(["bash", "-c", script])
    return out.decode().strip()


def test_r11_allowed_name_is_reachable_through_the_proxy(stub, egress, target_net):
    ticket, _, _ = egress
    assert run(stub, ticket, FETCH.format(url=f"http://{target_net['name']}/")).stdout.strip() == b"TARGET-OK"


def test_r11_other_name_is_refused(stub, egress, target_net, docker_client):
    ticket, _, proxy = egress
    alias = "other-" + target_net["name"]     # the same server under a name not on the allowlist
    url = f"http://{alias}/"
    assert run(stub, ticket, FETCH.format(url=url)).stdout.strip() == b"HTTP 403"
    assert in_proxy(proxy, FETCH.format(url=url).replace("python3 -", "env -u http_proxy -u HTTP_PROXY python3 -")) \
        == "TARGET-OK"                                                     # positive control


@pytest.mark.parametrize("form", ["dotted", "decimal", "octal", "hex", "v6"])
def test_r11_ip_literals_are_refused(stub, egress, target_net, form):
    ticket, _, proxy = egress
    ip = ipaddress.ip_address(target_net["ip"])
    host = {"dotted": str(ip), "decimal": str(int(ip)),
            "octal": ".".join(f"0{int(o):o}" for o in str(ip).split(".")),
            "hex": hex(int(ip)), "v6": f"[::ffff:{ip}]"}[form]
    assert run(stub, ticket, FETCH.format(url=f"http://{host}/")).stdout.strip() == b"HTTP 403"
    if form == "dotted":   # positive control: the IP itself serves
        assert in_proxy(proxy, FETCH.format(url=f"http://{ip}/")) == "TARGET-OK"


def test_r11_connect_only_to_443(stub, egress, target_net):
    ticket, _, _ = egress
    name = target_net["name"]
    assert "200" in run(stub, ticket, CONNECT.format(dest=f"{name}:443")).stdout.decode()
    assert "403" in run(stub, ticket, CONNECT.format(dest=f"{name}:8080")).stdout.decode()
    assert "403" in run(stub, ticket, CONNECT.format(dest=f"{name}:80")).stdout.decode()


def test_r11_plain_http_only_to_80_and_443(stub, egress, target_net):
    ticket, _, proxy = egress
    url = f"http://{target_net['name']}:8080/"
    assert run(stub, ticket, FETCH.format(url=url)).stdout.strip() == b"HTTP 403"
    assert in_proxy(proxy, DIRECT.format(ip=target_net["ip"], port=8080)) == "CONNECTED"   # control


def test_r11_name_resolving_to_loopback_is_refused(stub, egress, target_net):
    ticket, _, _ = egress
    # "localhost" IS on the allowlist, but resolves to 127.0.0.1: asked of the proxy, it refuses
    via_proxy = FETCH.format(url="http://localhost/").replace("python3 -", "env NO_PROXY= no_proxy= python3 -")
    assert run(stub, ticket, via_proxy).stdout.strip() == b"HTTP 403"
    # (the sandbox's own loopback is not proxied, NO_PROXY: the model relay's forwarder listens there;
    # nothing serves port 80 on it)
    assert run(stub, ticket, FETCH.format(url="http://localhost/")).stdout.strip() == b"ERR URLError"
    # control: the (private) target passes only because its subnet is exempted for the test
    assert run(stub, ticket, FETCH.format(url=f"http://{target_net['name']}/")).stdout.strip() == b"TARGET-OK"


def test_r11_direct_tcp_bypassing_the_proxy_fails(stub, egress, target_net):
    ticket, _, proxy = egress
    probe = DIRECT.format(ip=target_net["ip"], port=80)
    assert run(stub, ticket, probe).stdout.strip().startswith(b"ERR")
    assert in_proxy(proxy, probe) == "CONNECTED"       # positive control


def test_r11_dns_from_the_sandbox_resolves_nothing(stub, egress, target_net):
    ticket, _, proxy = egress
    probe = f"getent hosts {target_net['name']} && echo RESOLVED || echo FAILED"
    assert run(stub, ticket, probe).stdout.strip() == b"FAILED"
    assert in_proxy(proxy, probe).endswith("RESOLVED")  # positive control


def test_r10_r12_network_proxy_and_sandbox_are_labelled(egress, docker_client, broker, runtime):
    ticket, sb, proxy = egress
    inst = broker.instance
    sandbox = docker_client.containers.get(sb.container_id)
    owned = [(sandbox.labels, "sandbox"), (proxy.labels, "proxy")]
    if runtime == "runc":
        assert sandbox.attrs["HostConfig"]["NetworkMode"] == sb.network
        net = docker_client.networks.get(sb.network)
        assert net.attrs["Internal"] is True
        owned.append((net.attrs["Labels"], "network"))
    else:   # no interface: the proxy's socket folder, read-only, is the way out
        assert sandbox.attrs["HostConfig"]["NetworkMode"] == "none" and sb.network == ""
        assert sandbox.attrs["HostConfig"]["Runtime"] == "runsc"
        assert sandbox.labels["afe.runtime"] == "gvisor" and sandbox.labels["afe.egress"] == "socket"
        mounts = {m["Destination"]: m for m in sandbox.attrs["Mounts"]}
        assert mounts["/run/afe-egress"]["RW"] is False
    for labels, role in owned:
        assert labels["afe.ticket"] == ticket and labels["afe.instance"] == inst and labels["afe.role"] == role
    assert proxy.attrs["HostConfig"]["CapDrop"] == ["ALL"] and proxy.attrs["HostConfig"]["ReadonlyRootfs"]


def test_r11_ticket_a_cannot_reach_ticket_b(stub, egress, docker_client, broker, runtime):
    ticket_a, sb_a, proxy_a = egress
    ticket_b = "egress-" + new_instance("b")
    sb_b = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket_b, spec=pb.SandboxSpec(
        egress=["x.invalid"], runtime=spec_runtime(runtime))))
    try:
        proxy_b = docker_client.containers.get(sb_b.proxy_container_id)
        ips_b = [n["IPAddress"] for n in proxy_b.attrs["NetworkSettings"]["Networks"].values()]
        nets_b = docker_client.containers.get(sb_b.container_id).attrs["NetworkSettings"]["Networks"]
        sandbox_b_ips = [n["IPAddress"] for n in nets_b.values() if n.get("IPAddress")]
        assert runtime == "runc" or sandbox_b_ips == []              # gVisor: B has no address at all
        for ip in [*ips_b, *sandbox_b_ips]:
            port = 3128 if ip in ips_b else 22
            assert run(stub, ticket_a, DIRECT.format(ip=ip, port=port)).stdout.strip().startswith(b"ERR"), ip
        if runtime == "runc":
            own = proxy_a.attrs["NetworkSettings"]["Networks"][sb_a.network]["IPAddress"]
        else:
            own = "127.0.0.1"     # A's forwarder to its own proxy's socket
        assert run(stub, ticket_a, DIRECT.format(ip=own, port=3128)).stdout.strip() == b"CONNECTED"  # control
    finally:
        removed = stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket_b)).removed
    assert removed == (3 if runtime == "runc" else 2)      # sandbox, proxy (and the ticket's network)
    flt = {"label": [f"afe.ticket={ticket_b}", f"afe.instance={broker.instance}"]}
    assert docker_client.containers.list(all=True, filters=flt) == []
    assert docker_client.networks.list(filters=flt) == []


def test_r11_proxy_listens_only_on_its_port_and_caches_nothing(egress, runtime):
    _, _, proxy = egress
    listening = in_proxy(proxy, "ss -Hlnt | awk '{print $4}'").split()
    # gVisor's sandbox reaches it through its socket: squid listens on the proxy's loopback alone
    assert [a for a in listening if not a.startswith("127.0.0.11:")] == \
        (["0.0.0.0:3128"] if runtime == "runc" else ["127.0.0.1:3128"])
    conf = proxy.attrs["Config"]["Env"]
    assert any("cache deny all" in e for e in conf) and not any("cache_dir" in e for e in conf)
