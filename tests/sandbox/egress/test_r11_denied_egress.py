"""DeniedEgress (R11) against the real broker and proxy: the host names the
ticket's proxy refused come back from its access log, names only; the
allowed target (a server the tests start on their own network) does not."""

from __future__ import annotations

import time

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from tests.sandbox.conftest import run, spec_runtime
from tests.sandbox.egress.test_egress import CONNECT, FETCH
from tests.support.sandbox_broker import new_instance

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]


def denied(stub, ticket: str, expect: str, count: int) -> pb.DeniedEgressResponse:
    """DeniedEgress once it counts `count` refusals of `expect` (the engine hands on
    the proxy's log a moment after squid writes it), else its last answer."""
    for _ in range(100):
        r = stub.DeniedEgress(pb.DeniedEgressRequest(ticket_id=ticket), timeout=30)
        if any(h.host == expect and h.count >= count for h in r.hosts):
            break
        time.sleep(0.1)
    return r


def test_r11_denied_egress_lists_the_refused_host_names(stub, target_net, docker_client, runtime):
    ticket = "denied-" + new_instance("a")
    name = target_net["name"]
    other = "other-" + name                      # the same server under a name not on the allowlist
    sb = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(egress=[name],
                                                                                   runtime=spec_runtime(runtime))))
    try:
        assert stub.DeniedEgress(pb.DeniedEgressRequest(ticket_id=ticket), timeout=30).hosts == []
        # control: the allowed name is reachable, so a refusal below is the allowlist's doing
        assert run(stub, ticket, FETCH.format(url=f"http://{name}/ok")).stdout.strip() == b"TARGET-OK"
        url = f"http://{other}/private/path?token=s3cret"
        assert run(stub, ticket, FETCH.format(url=url)).stdout.strip() == b"HTTP 403"
        assert "403" in run(stub, ticket, CONNECT.format(dest=f"{other}:443")).stdout.decode()
        r = denied(stub, ticket, other, 2)
        assert [(h.host, h.count) for h in r.hosts] == [(other, 2)] and not r.truncated
        # what the proxy let through, counted the same way (the run record's allowed hosts, R42)
        assert [(h.host, h.count) for h in r.allowed] == [(name, 1)] and not r.allowed_truncated
        assert "s3cret" not in str(r) and name not in [h.host for h in r.hosts]
        assert "private" not in str(list(r.hosts)) + str(list(r.allowed))      # the host lists: names only
        # every request (R44) with its path, never its query
        assert [(q.method, q.host, q.path) for q in r.requests if q.denied and q.method == "GET"] == [
            ("GET", other, "/private/path")]
        # control: the proxy's log itself holds the path the answer leaves out (squid strips the query)
        assert f"{other}/private/path".encode() in docker_client.containers.get(sb.proxy_container_id).logs(stdout=True)
    finally:
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))


def test_r11_denied_egress_is_empty_without_egress(stub):
    ticket = "denied-" + new_instance("b")
    stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec()))
    try:
        r = stub.DeniedEgress(pb.DeniedEgressRequest(ticket_id=ticket), timeout=30)
        assert r.hosts == [] and not r.truncated and r.allowed == []
    finally:
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
