"""Fixtures for the sandbox broker's tests: the real broker (in a thread
with its own event loop, so fixtures can be module/session scoped), a sync
gRPC stub presenting the scheduler's link secret, and a test network with a
target HTTP server container for egress tests. Every Docker object carries a
unique afe.instance label and is removed by its creator."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import docker
import grpc
import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services._gen.afe.sandbox.v1 import sandbox_pb2_grpc
from services.cli.doctor import TARGET_SERVER
from services.common.host.images import SANDBOX_IMAGE, ensure_images
from services.common.layout import Layout
from services.common.rpc.grpcutil import _LinkAuth, socket_target
from tests.support.sandbox_broker import new_instance, sandbox_broker
from tests.support.temp_roots import remove_temp_root, temp_root

pytestmark = pytest.mark.docker

# The target container runs the doctor's tiny HTTP server: ports 80 and 443
# (plain HTTP; a CONNECT tunnel only needs the TCP connection) and 8080.


def sync_stub(socket_path: str, secret: bytes | None) -> tuple[grpc.Channel, sandbox_pb2_grpc.SandboxBrokerStub]:
    creds = grpc.local_channel_credentials(grpc.LocalConnectionType.UDS)
    if secret is not None:
        creds = grpc.composite_channel_credentials(creds, grpc.metadata_call_credentials(_LinkAuth(secret)))
    ch = grpc.secure_channel(socket_target(socket_path), creds)
    return ch, sandbox_pb2_grpc.SandboxBrokerStub(ch)


@dataclass
class ExecResult:
    code: int
    stdout: bytes
    stderr: bytes
    exit: pb.ExecExit


def run(stub, ticket: str, cmd: str | list[str], timeout_ms: int = 30000, **kw) -> ExecResult:
    argv = ["bash", "-c", cmd] if isinstance(cmd, str) else cmd
    out, err, ex = [], [], None
    for ev in stub.Exec(pb.ExecRequest(ticket_id=ticket, argv=argv, timeout_ms=timeout_ms, **kw), timeout=120):
        k = ev.WhichOneof("event")
        if k == "stdout":
            out.append(ev.stdout)
        elif k == "stderr":
            err.append(ev.stderr)
        else:
            ex = ev.exit
    assert ex is not None, "Exec stream ended without an Exit"
    return ExecResult(ex.code, b"".join(out), b"".join(err), ex)


class BrokerThread:
    """Runs tests.support.sandbox_broker in a private event loop thread."""

    def __init__(self, layout: Layout, **kw) -> None:
        self.layout = layout
        self.kw = kw
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_event: asyncio.Event | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        async def body() -> None:
            self.loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()
            async with sandbox_broker(self.layout, **self.kw) as (sock, secret, inst):
                self.socket, self.secret, self.instance = sock, secret, inst
                self.ready.set()
                await self.stop_event.wait()
        try:
            asyncio.run(body())
        except BaseException as exc:  # noqa: BLE001 - surfaced by start()
            self.error = exc
            self.ready.set()

    def start(self) -> BrokerThread:
        self.thread.start()
        self.ready.wait(300)
        if self.error:
            raise self.error
        return self

    def stop(self) -> None:
        if self.loop and self.stop_event:
            self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(60)


@pytest.fixture(scope="session")
def docker_client():
    ensure_images(progress=lambda _m: None)
    return docker.from_env()


@pytest.fixture(scope="session")
def test_instance() -> str:
    return new_instance("ts")


@pytest.fixture(scope="session")
def target_net(docker_client, test_instance):
    """A user-defined network of our own with a target server named
    `target-<instance>` and also `other-target-<instance>` (both resolvable
    by Docker's DNS on that network)."""
    net = docker_client.networks.create(f"afe-test-{test_instance}", labels={"afe.instance": test_instance})
    net.reload()
    subnet = net.attrs["IPAM"]["Config"][0]["Subnet"]
    name = f"target-{test_instance}"
    api = docker_client.api
    cid = api.create_container(
        SANDBOX_IMAGE, ["python3", "-c", TARGET_SERVER], user="0", name=name,
        labels={"afe.instance": test_instance},
        host_config=api.create_host_config(network_mode=net.name),
        networking_config=api.create_networking_config(
            {net.name: api.create_endpoint_config(aliases=[name, "other-" + name])}))["Id"]
    tgt = docker_client.containers.get(cid)
    tgt.start()
    for _ in range(100):
        if b"ready" in tgt.logs():
            break
        import time
        time.sleep(0.1)
    tgt.reload()
    ip = tgt.attrs["NetworkSettings"]["Networks"][net.name]["IPAddress"]
    try:
        yield {"network": net.name, "subnet": subnet, "name": name, "ip": ip, "container": tgt}
    finally:
        tgt.remove(force=True)
        net.remove()


@pytest.fixture(scope="package")
def broker_root():
    d = temp_root("afe-sbt-")
    try:
        yield d
    finally:
        remove_temp_root(d)


@pytest.fixture(scope="package")
def broker(broker_root, target_net, test_instance):
    """One real broker for this package's tests in a row; its proxies' outside
    network is the test network and the target's subnet is exempt from the
    private refusal. Package-scoped, not session-scoped: its gRPC server runs on
    an event loop in a thread of its own, and grpc.aio driven from two threads'
    loops at once (this one, and the main thread's in another area's tests,
    which a parallel run puts in the same worker) crashed workers with a
    segmentation fault; it stops when the worker moves on to another folder."""
    layout = Layout(broker_root / "data", broker_root / "run")
    b = BrokerThread(layout, instance=test_instance + "b", egress_network=target_net["network"],
                     allow_private=(target_net["subnet"],),
                     env_values={"AGENT_KEY": "agent-secret-value-123"}).start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture(scope="package")
def stub(broker):
    ch, s = sync_stub(broker.socket, broker.secret)
    try:
        yield s
    finally:
        ch.close()


RUNTIMES = ("runc", "gvisor")


def gvisor_missing(client: docker.DockerClient) -> str | None:
    """Why gVisor sandboxes cannot run on this engine, or None."""
    if "runsc" not in (client.info().get("Runtimes") or {}):
        return ("the Docker engine has no `runsc` runtime (gVisor): .ci/run installs and registers it "
                "(scripts/ensure_runsc.sh); see the README")
    return None


@pytest.fixture(scope="module", params=RUNTIMES)
def runtime(request, docker_client) -> str:
    """Each sandbox attack test runs under both runtimes (runc, and gVisor's
    runsc when the engine has it)."""
    if request.param == "gvisor" and (why := gvisor_missing(docker_client)):
        pytest.skip(why)
    return request.param


def spec_runtime(runtime: str) -> str:
    """SandboxSpec.runtime for a runtime name ("" is runc)."""
    return "" if runtime == "runc" else runtime


@pytest.fixture(scope="module")
def plain_sandbox(stub, broker, runtime):
    """A sandbox without egress, shared by a module's tests (under each runtime)."""
    ticket = "plain-" + new_instance("m")
    stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(
        env_names=["AGENT_KEY"], runtime=spec_runtime(runtime))))
    try:
        yield ticket
    finally:
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))


@pytest.fixture
def idle_container(docker_client):
    """A plain container of the sandbox image that sleeps (no broker, no network), removed after the test."""
    c = docker_client.containers.run(SANDBOX_IMAGE, ["sleep", "300"], detach=True, user="1000:1000",
                                     labels={"afe.test": "idle-container"}, network_mode="none")
    try:
        yield c
    finally:
        c.remove(force=True)
