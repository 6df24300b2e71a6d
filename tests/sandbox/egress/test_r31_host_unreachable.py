"""R31: an egress sandbox reaches nothing but its own proxy's port: no address
of the host on any interface (Docker bridges, eth0, IPv6 link-local), not its
network's gateway, no other container, no other ticket; TCP, UDP and ICMP.

A listener on this host (TCP and UDP on 0.0.0.0 and ::, `afe doctor`'s
LISTENER) records what arrives; the probe (`afe doctor`'s PROBE) runs inside
an egress sandbox made by the real broker. Positive controls run the same
probe from a plain container on the default bridge, and from containers with
the sandbox's hardening but one defence taken away, to show the host answers.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.cli.doctor import LISTENER, PROBE, HostListener, host_addresses, reached
from services.common.errors import FailedPrecondition
from services.common.host.images import SANDBOX_IMAGE
from services.common.layout import SANDBOX_GID, SANDBOX_UID
from services.sandbox.containers import hardening
from services.sandbox.sandboxes import bridge_ipv4, check_bridge_has_no_address
from tests.sandbox.conftest import gvisor_missing, run
from tests.support.sandbox_broker import new_instance

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

B_PORT = 47031      # the listener inside ticket B's sandbox (its own network namespace)
HARDENED = {"cap_drop": ["ALL"], "security_opt": ["no-new-privileges"], "user": f"{SANDBOX_UID}:{SANDBOX_GID}"}


@pytest.fixture(scope="module")
def listener():
    with HostListener() as lst:
        yield lst


@pytest.fixture(scope="module")
def tickets(stub):
    """Two egress sandboxes (tickets A and B) made through the real broker."""
    names = ["r31a-" + new_instance("a"), "r31b-" + new_instance("b")]
    made = []
    try:
        for t in names:
            made.append(stub.CreateSandbox(pb.CreateSandboxRequest(
                ticket_id=t, spec=pb.SandboxSpec(egress=["x.invalid"]))))
        yield made
    finally:
        for t in names:
            stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=t))


def gateway(docker_client, network: str) -> str:
    """The gateway as Docker reports it in the IPAM config, else (the default
    bridge reports none) the address of the network's bridge interface."""
    net = docker_client.api.inspect_network(network)
    gw = net["IPAM"]["Config"][0].get("Gateway")
    if gw:
        return gw
    dev = net["Options"].get(hardening.BRIDGE_NAME) or "br-" + net["Id"][:12]
    return next(a["local"] for a in ip_addrs(dev) if a["family"] == "inet")


def ip_addrs(dev: str) -> list[dict]:
    doc = json.loads(subprocess.run(["ip", "-j", "addr", "show", "dev", dev], capture_output=True, text=True,
                                    check=True).stdout)
    return doc[0].get("addr_info", [])


def probe_in_sandbox(stub, ticket: str, token: str, port: int, targets: list[str]) -> dict:
    r = run(stub, ticket, ["python3", "-c", PROBE, token, str(port), *targets], timeout_ms=60000)
    assert r.code == 0, r.stderr
    return json.loads(r.stdout)


def probe_in_container(container, token: str, port: int, targets: list[str]) -> dict:
    code, out = container.exec_run(["python3", "-c", PROBE, token, str(port), *targets])
    assert code == 0, out
    return json.loads(out)


def probe_from_new_container(docker_client, instance: str, token: str, port: int, targets: list[str],
                             **kw) -> dict:
    out = docker_client.containers.run(SANDBOX_IMAGE, ["python3", "-c", PROBE, token, str(port), *targets],
                                       remove=True, labels={"afe.instance": instance}, **HARDENED, **kw)
    return json.loads(out)


def test_r31_ticket_bridge_has_no_host_address_and_sandbox_no_ipv6(stub, tickets, docker_client, target_net):
    sb = tickets[0]
    net = docker_client.api.inspect_network(sb.network)
    bridge = hardening.bridge_name(sb.network)
    assert net["Options"][hardening.INHIBIT_IPV4] == "true" and net["Options"][hardening.BRIDGE_NAME] == bridge
    assert net["Internal"] is True
    assert [a for a in ip_addrs(bridge) if a["family"] == "inet"] == []
    assert bridge_ipv4(bridge) == ""
    check_bridge_has_no_address(bridge)
    # control: an ordinary bridge (the test network's) has the host's address, and the check refuses it
    tnet = docker_client.api.inspect_network(target_net["network"])
    tbridge = "br-" + tnet["Id"][:12]
    assert bridge_ipv4(tbridge) == gateway(docker_client, target_net["network"])
    with pytest.raises(FailedPrecondition, match="upgrade Docker"):
        check_bridge_has_no_address(tbridge)
    assert bridge_ipv4("afe-no-such-if") is None

    attrs = docker_client.api.inspect_container(sb.container_id)
    assert attrs["HostConfig"]["Sysctls"] == hardening.NO_IPV6_SYSCTLS
    lines = run(stub, sb.ticket_id, "cat /proc/sys/net/ipv6/conf/all/disable_ipv6 "
                                    "/proc/sys/net/ipv6/conf/eth0/disable_ipv6 /proc/net/if_inet6").stdout
    lines = lines.decode().splitlines()
    assert lines[:2] == ["1", "1"] and not any(line.endswith("eth0") for line in lines[2:]), lines


def test_r31_egress_sandbox_reaches_no_host_address(stub, tickets, listener, docker_client, test_instance):
    sb = tickets[0]
    hosts = host_addresses()
    gw = gateway(docker_client, sb.network)
    bridge_ll = [a["local"] + "%eth0" for a in ip_addrs(hardening.bridge_name(sb.network))
                 if a["family"] == "inet6"]
    default_gw = gateway(docker_client, "bridge")
    assert default_gw in hosts and bridge_ll and set(bridge_ll) <= set(hosts)
    targets = [*hosts, gw]
    sbx, ctl = "sbx-" + new_instance("t"), "ctl-" + new_instance("t")

    res = probe_in_sandbox(stub, sb.ticket_id, sbx, listener.port, targets)
    assert set(res) == set(targets)
    # positive control: the same probe from a plain container on the default bridge
    cres = probe_from_new_container(docker_client, test_instance, ctl, listener.port, targets, network="bridge")
    still = set(host_addresses())    # other tests may remove networks meanwhile
    v4 = [a for a in hosts if ":" not in a and a in still]
    lines = listener.wait_for(ctl, 2 * len(v4))
    got = set(reached(cres, lines))
    for a in v4:
        assert {f"tcp {a}", f"udp {a}", f"icmp {a}"} <= got, (a, sorted(got))
    assert default_gw in v4

    assert reached(res, listener.received(sbx)) == [], res
    assert all(r["icmp"] != "REPLY" and r["tcp"] != "CONNECTED" for r in res.values())
    assert listener.received(sbx) == []


def test_r31_without_the_defences_the_host_answers(stub, tickets, listener, docker_client, test_instance):
    """What each defence stops: a ticket network without inhibit_ipv4 gives
    the host an address (its gateway) the sandbox reaches; a container on the
    real ticket network with IPv6 left on reaches the bridge's link-local."""
    sb = tickets[0]
    twin = docker_client.networks.create(**{
        **hardening.ticket_network_kwargs(name=f"afe-r31-twin-{test_instance}", instance=test_instance,
                                          ticket_id="r31-twin"),
        "options": {"com.docker.network.bridge.enable_icc": "true"}})
    try:
        gw = gateway(docker_client, twin.name)
        tok = "twin-" + new_instance("t")
        res = probe_from_new_container(docker_client, test_instance, tok, listener.port, [gw], network=twin.name)
        assert reached(res, listener.wait_for(tok, 2)) == [f"icmp {gw}", f"tcp {gw}", f"udp {gw}"]
    finally:
        twin.remove()

    bridge_ll = [a["local"] + "%eth0" for a in ip_addrs(hardening.bridge_name(sb.network))
                 if a["family"] == "inet6"]
    tok = "v6-" + new_instance("t")
    c = docker_client.containers.create(
        SANDBOX_IMAGE, ["sleep", "infinity"], labels={"afe.instance": test_instance}, network=sb.network,
        sysctls={"net.ipv6.conf.all.disable_ipv6": "0", "net.ipv6.conf.eth0.disable_ipv6": "0"}, **HARDENED)
    try:
        c.start()
        # Duplicate address detection on the new link-local takes a moment: retry, bounded.
        for _ in range(20):
            res = probe_in_container(c, tok, listener.port, bridge_ll)
            if all(r["tcp"] == "CONNECTED" for r in res.values()):
                break
            time.sleep(0.5)
        got = reached(res, listener.wait_for(tok, 2 * len(bridge_ll)))
        assert {f"{k} {a}" for a in bridge_ll for k in ("tcp", "udp", "icmp")} <= set(got), got
    finally:
        c.remove(force=True)


def test_r31_egress_sandbox_cannot_reach_another_ticket(stub, tickets, docker_client):
    sa, sbb = tickets
    b = docker_client.containers.get(sbb.container_id)
    b.exec_run(["sh", "-c", f'exec python3 -c "$AFE_L" {B_PORT} > /tmp/r31.log 2>&1'],
               environment={"AFE_L": LISTENER}, detach=True)
    for _ in range(100):
        if b"ready" in b.exec_run(["cat", "/tmp/r31.log"]).output:
            break
    proxy_b = docker_client.containers.get(sbb.proxy_container_id)
    b_ip = b.attrs["NetworkSettings"]["Networks"][sbb.network]["IPAddress"]
    proxy_b_ips = [n["IPAddress"] for n in proxy_b.attrs["NetworkSettings"]["Networks"].values()]
    proxy_a = docker_client.containers.get(sa.proxy_container_id)
    own = proxy_a.attrs["NetworkSettings"]["Networks"][sa.network]["IPAddress"]

    tok = "xa-" + new_instance("t")
    res = probe_in_sandbox(stub, sa.ticket_id, tok, B_PORT, [b_ip, *proxy_b_ips])
    res3128 = probe_in_sandbox(stub, sa.ticket_id, tok, 3128, proxy_b_ips)
    assert reached(res, []) == [] and reached(res3128, []) == [], (res, res3128)
    # controls: ticket B's own proxy reaches B's listener; A reaches its own proxy's port
    ctl = "xb-" + new_instance("t")
    cres = probe_in_container(proxy_b, ctl, B_PORT, [b_ip])
    for _ in range(100):
        log = b.exec_run(["cat", "/tmp/r31.log"]).output.decode()
        if f"udp {ctl} udp {b_ip}" in log:
            break
    assert reached(cres, log.splitlines()) == [f"icmp {b_ip}", f"tcp {b_ip}", f"udp {b_ip}"]
    assert tok not in log
    own_res = probe_in_sandbox(stub, sa.ticket_id, tok, 3128, [own])
    assert own_res[own]["tcp"] == "CONNECTED"


def test_r31_gvisor_egress_sandbox_has_no_interface_and_reaches_no_host_address(
        stub, listener, docker_client, test_instance):
    """A gVisor egress sandbox has no network interface at all (its proxy is a
    socket away, egress_socket.py): no host address, v4 or v6, answers it.
    Positive control: the same probe from a plain container on the default
    bridge reaches the host."""
    if why := gvisor_missing(docker_client):
        pytest.skip(why)
    ticket = "r31g-" + new_instance("g")
    sb = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(
        egress=["x.invalid"], runtime="gvisor")))
    try:
        assert sb.network == ""
        attrs = docker_client.api.inspect_container(sb.container_id)
        assert attrs["HostConfig"]["NetworkMode"] == "none" and attrs["HostConfig"]["Runtime"] == "runsc"
        hosts = host_addresses()
        targets = [*hosts, gateway(docker_client, "bridge")]
        tok = "gsbx-" + new_instance("t")
        res = probe_in_sandbox(stub, ticket, tok, listener.port, targets)
        ctl = "gctl-" + new_instance("t")
        cres = probe_from_new_container(docker_client, test_instance, ctl, listener.port, targets, network="bridge")
        v4 = [a for a in hosts if ":" not in a and a in set(host_addresses())]
        assert set(reached(cres, listener.wait_for(ctl, 2 * len(v4))))      # positive control
        assert reached(res, listener.received(tok)) == [], res
        assert all(r["icmp"] != "REPLY" and r["tcp"] != "CONNECTED" for r in res.values())
    finally:
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
