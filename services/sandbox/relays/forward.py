"""Forwarders inside a sandbox from its own loopback to a Unix socket the
broker mounted: the model relay's (R32) and, for a sandbox without a network
interface, the egress proxy's (egress/over_socket.py).

The credential broker serves the ticket's relay on a Unix socket; the
sandbox broker mounts that socket's folder read-only at `RELAY_MOUNT`. Agents
speak HTTP over TCP to a base URL, so this small program, started by the
sandbox broker in the sandbox as the sandbox user, listens on the sandbox's
own loopback (`127.0.0.1:RELAY_PORT`, which exists even with `--network
none`) and copies each connection to the socket, byte for byte, in both
directions (no buffering: streamed answers pass as they come), all of them
from one thread (socket_relay.py: opening connections cannot use up the
sandbox's pids). The egress forwarder is the same program on `EGRESS_PORT`,
to the proxy's socket.

It binds first and then detaches, so the exec that starts it returns once
it listens; a second start finds the port taken and exits 0 (idempotent).
"""

from __future__ import annotations

import time
from pathlib import Path

import docker

from services.common.errors import FailedPrecondition, Unavailable
from services.common.relayenv import RELAY_MOUNT, RELAY_PORT, RELAY_SOCKET

NO_PYTHON = 127     # the exec's exit code when the image has no python3
START_TIMEOUT_S = 30.0   # the forwarder listens within this, or the sandbox is not ready

# The relay both forwarders and the egress proxy's socket server run
# (socket_relay.py): one thread for all connections, at most a number at once.
RELAY_SOURCE = Path(__file__).with_name("socket_relay.py").read_text()
MAX_CONNECTIONS = 512       # per forwarder; the egress proxy (256) and the model relay (64) refuse earlier

TEMPLATE = """
SOCK = {sock!r}
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", {port}))
except OSError as e:
    sys.exit(0 if e.errno == errno.EADDRINUSE else 2)
s.listen(128)
if os.fork():
    os._exit(0)
os.setsid()
null = os.open("/dev/null", os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
Relay(s, SOCK, {max_connections}).run()
"""


def source(port: int, sock: str) -> str:
    """The forwarder's program: 127.0.0.1:`port` to the Unix socket `sock`."""
    return RELAY_SOURCE + TEMPLATE.format(port=int(port), sock=sock, max_connections=MAX_CONNECTIONS)


SOURCE = source(RELAY_PORT, f"{RELAY_MOUNT}/{RELAY_SOCKET}")   # the model relay's (R32)


def argv(program: str = SOURCE) -> list[str]:
    return ["python3", "-c", program]


def start(client: docker.DockerClient, container_id: str, program: str = SOURCE,
          what: str = "the model relay's forwarder (R32)") -> None:
    """Run a forwarder (the relay's by default) in the sandbox, as the
    sandbox user; it returns once it listens (or finds one listening already).

    The exec is started detached and its end watched with a deadline: reading
    its output instead blocked for good when the stream was not closed (seen
    with gVisor on a loaded machine), and the thread then held up the broker's
    stop."""
    e = client.api.exec_create(container_id, argv(program), workdir="/", environment={},
                               stdout=False, stderr=False)
    client.api.exec_start(e["Id"], detach=True)
    end = time.monotonic() + START_TIMEOUT_S
    delay = 0.002
    while True:
        info = client.api.exec_inspect(e["Id"])
        code = info.get("ExitCode")
        if not info.get("Running") and code is not None:
            break
        if time.monotonic() > end:
            raise Unavailable(f"{what} did not start in the sandbox within {START_TIMEOUT_S:.0f} s")
        time.sleep(delay)       # on a worker thread: every caller runs this under asyncio.to_thread
        delay = min(delay * 1.5, 0.05)
    if code == 0:
        return
    if code in (NO_PYTHON, 126):
        raise FailedPrecondition(f"the sandbox image has no python3, which runs {what}; use an image built "
                                 "on afe/sandbox")
    raise Unavailable(f"{what} did not start in the sandbox (exit {code})")
