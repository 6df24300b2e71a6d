"""Starting a relay forwarder in a sandbox is bounded: an exec that never ends
(its output stream never closed, as seen with gVisor on a loaded machine)
fails the start after START_TIMEOUT_S instead of holding a broker thread, and
with it the broker's stop, for good."""

from __future__ import annotations

import threading
import time

import docker
import pytest

from services.common.errors import Unavailable
from services.sandbox.relays import forward as relayforward

pytestmark = pytest.mark.docker

NEVER_ENDS = "import time\ntime.sleep(600)\n"


def test_a_forwarder_that_never_returns_fails_the_start_within_its_bound(idle_container, monkeypatch):
    monkeypatch.setattr(relayforward, "START_TIMEOUT_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="did not start in the sandbox within 1 s"):
        relayforward.start(docker.from_env(), idle_container.id, NEVER_ENDS, what="a test forwarder")
    assert time.monotonic() - t0 < 10


def test_the_real_forwarder_starts_and_a_second_start_finds_it_listening(idle_container):
    client = docker.from_env()
    relayforward.start(client, idle_container.id, relayforward.source(47001, "/tmp/none.sock"))
    relayforward.start(client, idle_container.id, relayforward.source(47001, "/tmp/none.sock"))   # EADDRINUSE: 0


def test_positive_control_reading_the_execs_output_blocks_as_long_as_it_runs(idle_container):
    client = docker.from_env()
    e = client.api.exec_create(idle_container.id, relayforward.argv(NEVER_ENDS), stdout=True, stderr=True)
    reader = threading.Thread(target=client.api.exec_start, args=(e["Id"],), daemon=True)
    reader.start()
    reader.join(3)
    assert reader.is_alive()        # still reading; the fixture's removal of the container ends it
