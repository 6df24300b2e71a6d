"""Egress without an interface (egress_socket.py) under a flood of held
connections (issue 34): a gVisor sandbox opens hundreds of connections
straight to its proxy's Unix socket and holds them. The proxy container's
relay (socket_relay.py) keeps serving: a request from the sandbox
still goes through with 150 held, connections over the relay's limit are
closed at once and logged once, and once they are let go a request goes
through again. The positive control runs the threaded server it replaced,
which the same flood cuts off for good (its accept thread cannot start a
thread under the proxy's pids limit)."""

from __future__ import annotations

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.sandbox.containers import hardening
from services.sandbox.egress import over_socket as egress_socket
from tests.sandbox.conftest import gvisor_missing, run
from tests.sandbox.egress.egress_threaded_relay import THREADED_PROXY_MAIN
from tests.support.sandbox_broker import new_instance

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]

# The threaded server died at about 60. More than 60 + its backlog of 128
# would not do for its control: under gVisor a connect() to a host socket
# whose backlog is full blocks past its timeout, and even past SIGTERM.
HELD = 150
EXTRA = 20          # over the relay's limit

# Run in the sandbox: hold HELD connections to the proxy's socket, then ask
# for the target through the sandbox's forwarder (HTTP_PROXY); with `extra`,
# fill the relay to its limit and EXTRA more, see which are closed at once,
# let all go and ask again.
FLOOD = """python3 - {held} {url} {limit} {extra} <<'EOF'
import select, socket, sys, time, urllib.request
held_n, url, limit, extra = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
SOCK = "/run/afe-egress/proxy.sock"

def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    deadline = time.monotonic() + 5
    while True:
        try:
            s.connect(SOCK)
            return s
        except BlockingIOError:          # the backlog is full: wait a little for the server to accept
            if time.monotonic() > deadline:
                s.close()
                return None
            time.sleep(0.005)

def fetch():
    try:
        return urllib.request.urlopen(url, timeout=3).read().decode()
    except Exception as e:
        return "ERR " + type(e).__name__

def gone(s):
    if not select.select([s], [], [], 0)[0]:
        return False
    try:
        return s.recv(1) == b""
    except OSError:
        return True

held = []
for _ in range(held_n):
    s = connect()
    if s is None:
        break
    held.append(s)
print("held", len(held), flush=True)
time.sleep(1)
print("fetch", fetch(), flush=True)
if extra:
    time.sleep(1)                        # the fetch's own connection is let go
    held += [s for s in (connect() for _ in range(limit - len(held) + extra)) if s is not None]
    time.sleep(1)
    print("closed", sum(gone(s) for s in held), "of", len(held), flush=True)
    print("fetch-full", fetch(), flush=True)
for s in held:
    s.close()
time.sleep(1)
print("fetch-after", fetch(), flush=True)
EOF"""


@pytest.fixture
def gvisor(docker_client):
    if why := gvisor_missing(docker_client):
        pytest.skip(why)


def flood(stub, docker_client, target_net, *, extra: int) -> tuple[dict[str, str], str]:
    """A gVisor sandbox (egress through its socket) floods its proxy; what
    the sandbox saw, line by line, and the proxy container's log."""
    ticket = "flood-" + new_instance("t")
    sb = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(
        egress=[target_net["name"]], runtime="gvisor")))
    try:
        assert sb.network == ""                          # no interface: the socket is the way out
        url = f"http://{target_net['name']}/"
        res = run(stub, ticket, FLOOD.format(held=HELD, url=url, limit=egress_socket.MAX_CONNECTIONS, extra=extra),
                  timeout_ms=120_000)
        assert res.code == 0, res.stderr.decode()[-2000:]
        seen = dict(line.split(" ", 1) for line in res.stdout.decode().splitlines())
        logs = docker_client.containers.get(sb.proxy_container_id).logs(stdout=False, stderr=True).decode()
        return seen, logs
    finally:
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))


def test_a_flood_of_held_connections_on_the_egress_socket_leaves_the_proxy_serving(
        gvisor, stub, docker_client, target_net):
    seen, logs = flood(stub, docker_client, target_net, extra=EXTRA)
    assert seen["held"] == str(HELD)
    assert seen["fetch"] == "TARGET-OK"                  # served with 150 held
    total = egress_socket.MAX_CONNECTIONS + EXTRA
    assert seen["closed"] == f"{EXTRA} of {total}"       # over the limit: closed at once, the rest held
    assert seen["fetch-full"].startswith("ERR")           # full: the sandbox's own request is refused too
    assert seen["fetch-after"] == "TARGET-OK"            # let go: served again
    refusals = [line for line in logs.splitlines() if "afe egress relay: refused" in line]
    assert len(refusals) == 1, refusals                  # one line for the interval, not one per connection
    assert f"the limit of {egress_socket.MAX_CONNECTIONS} at once" in refusals[0]
    assert "can't start new thread" not in logs


def test_positive_control_the_threaded_relay_is_cut_off_for_good_by_the_same_flood(
        gvisor, stub, docker_client, target_net, monkeypatch):
    monkeypatch.setattr(hardening, "proxy_command", lambda *a, **kw: ["python3", "-c", THREADED_PROXY_MAIN])
    seen, logs = flood(stub, docker_client, target_net, extra=0)
    assert "RuntimeError: can't start new thread" in logs
    assert seen["fetch"].startswith("ERR")
    assert seen["fetch-after"].startswith("ERR")         # all let go: still nothing accepts
