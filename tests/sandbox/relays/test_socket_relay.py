"""The socket relay (socket_relay.py) on the host: the egress proxy's
direction (a temporary Unix socket in front of a TCP server of the test's
own) and the sandbox forwarders' (a loopback port in front of a Unix
socket, as relayforward.py's program). What it must do: copy both ways
intact (with back-pressure and half-close), relay every connection from one
thread, refuse connections over its limit at once (counted, one log line
per interval), keep accepting, and wait for a Unix upstream's full backlog
as a blocking connect would."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.sandbox.relays import forward as relayforward
from services.sandbox.relays.socket_relay import CHUNK, Relay

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[3]


class Upstream:
    """A server on 127.0.0.1 (or on the Unix socket `path`): `echo` copies
    back what it gets as it comes; `after-eof` reads to EOF, then answers
    with what it got, reversed."""

    def __init__(self, mode: str = "echo", path: str | None = None, backlog: int = 512,
                 accepting: bool = True) -> None:
        self.mode = mode
        if path is None:
            self.sock = socket.create_server(("127.0.0.1", 0), backlog=backlog)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(path)
            self.sock.listen(backlog)
        self.addr = self.sock.getsockname()
        self.accepting = threading.Event()
        if accepting:
            self.accepting.set()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.accepting.wait()
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        with c:
            got = bytearray()
            while d := c.recv(CHUNK):
                if self.mode == "echo":
                    c.sendall(d)
                else:
                    got += d
            if self.mode == "after-eof":
                c.sendall(bytes(reversed(got)))


@contextlib.contextmanager
def relay(tmp_path: Path, upstream: tuple[str, int], max_connections: int = 64,
          log_every_s: float = 60.0) -> Iterator[tuple[str, Relay, list[str]]]:
    path = str(tmp_path / "proxy.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    lines: list[str] = []
    r = Relay(listener, upstream, max_connections, log_every_s=log_every_s, say=lines.append, tick_s=0.05)
    t = threading.Thread(target=r.run, daemon=True)
    t.start()
    try:
        yield path, r, lines
    finally:
        r.stop()
        t.join(5)
        r.close()
        listener.close()


def connect(path: str) -> socket.socket:
    """A connection to the relay's socket (waiting while its backlog is full:
    with a timeout set, connect() says EAGAIN then instead of blocking)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    deadline = time.monotonic() + 5
    while True:
        try:
            s.connect(path)
            return s
        except BlockingIOError:
            assert time.monotonic() < deadline, "the relay's backlog stayed full"
            time.sleep(0.005)


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def closed_at_once(s: socket.socket, within: float = 2.0) -> bool:
    """Did the relay close this connection (EOF or reset) within `within`?"""
    ready, _, _ = select.select([s], [], [], within)
    if not ready:
        return False
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_bytes_pass_both_ways_intact_past_a_slow_reader(tmp_path):
    """8 MiB echoed while the client reads slowly: the relay stops reading
    from a side whose destination is full and loses nothing."""
    up = Upstream("echo")
    payload = os.urandom(8 << 20)
    with relay(tmp_path, up.addr) as (path, r, _):
        s = connect(path)
        sender = threading.Thread(target=lambda: (s.sendall(payload), s.shutdown(socket.SHUT_WR)))
        sender.start()
        got = bytearray()
        while d := s.recv(CHUNK):
            got += d
            if len(got) < (1 << 20):
                time.sleep(0.002)      # slow at first: the relay must hold back, not buffer
            held = [c.up.pending for c in r.conns] + [c.down.pending for c in r.conns]
            assert all(len(p) <= CHUNK for p in held)
        sender.join(5)
        assert bytes(got) == payload
        wait_for(lambda: not r.conns)     # both sides ended: the pair is closed


def test_half_close_reaches_the_upstream_and_its_answer_comes_back(tmp_path):
    up = Upstream("after-eof")
    with relay(tmp_path, up.addr) as (path, r, _):
        s = connect(path)
        s.sendall(b"request body")
        s.shutdown(socket.SHUT_WR)              # the upstream answers only after our EOF
        answer = b""
        while d := s.recv(100):
            answer += d
        assert answer == b"ydob tseuqer"
        wait_for(lambda: not r.conns)


def test_no_upstream_closes_the_client_and_keeps_accepting(tmp_path):
    dead = socket.create_server(("127.0.0.1", 0))
    addr = dead.getsockname()
    dead.close()                                 # nothing listens there now
    with relay(tmp_path, addr) as (path, r, _):
        for _ in range(3):
            assert closed_at_once(connect(path))
        wait_for(lambda: not r.conns)


def test_one_thread_relays_hundreds_of_connections(tmp_path):
    """The relay as its own process (as in the proxy container) holding 300
    connections has one thread (the design the pids limit cannot stop); the
    old relay started two per connection."""
    up = Upstream("echo")
    path = str(tmp_path / "proxy.sock")
    program = (f"import socket, sys; sys.path.insert(0, {str(ROOT)!r})\n"
               "from services.sandbox.relays.socket_relay import Relay\n"
               "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(128)\n"
               "Relay(s, ('127.0.0.1', int(sys.argv[2])), 1000).run()\n")
    proc = subprocess.Popen([sys.executable, "-c", program, path, str(up.addr[1])])
    held: list[socket.socket] = []
    try:
        wait_for(lambda: os.path.exists(path))
        for _ in range(300):
            held.append(connect(path))
        for i, s in enumerate(held):
            s.sendall(b"%d" % i)
        for i, s in enumerate(held):
            assert s.recv(10) == b"%d" % i
        assert len(os.listdir(f"/proc/{proc.pid}/task")) == 1
    finally:
        for s in held:
            s.close()
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_connections_over_the_limit_are_closed_at_once_counted_and_logged_per_interval(tmp_path):
    up = Upstream("echo")
    with relay(tmp_path, up.addr, max_connections=4, log_every_s=0.5) as (path, r, lines):
        held = [connect(path) for _ in range(4)]
        for s in held:                         # all four are relayed
            s.sendall(b"x")
            assert s.recv(1) == b"x"
        extra = [connect(path) for _ in range(10)]
        assert all(closed_at_once(s) for s in extra)     # refused at once, not left hanging
        wait_for(lambda: r.refused_total == 10)          # counted by the relay's thread just after the close
        assert len(lines) == 1 and "refused 1 connection(s): 4 are open, the limit of 4" in lines[0]
        wait_for(lambda: len(lines) == 2)                # the other 9: one line after the interval
        assert "refused 9 connection(s) in the last" in lines[1] and "(10 refused in all)" in lines[1]
        time.sleep(0.7)
        assert len(lines) == 2                           # nothing refused since: nothing logged
        for s in held:                         # the held ones still work
            s.sendall(b"y")
            assert s.recv(1) == b"y"
        held[0].close()
        wait_for(lambda: len(r.conns) == 3)
        s = connect(path)                      # room again: relayed
        s.sendall(b"z")
        assert s.recv(1) == b"z"


class FailingListener(socket.socket):
    """A listening socket whose accept() fails with EMFILE while `fail` is set."""

    fail = True
    calls = 0

    def accept(self):  # type: ignore[override]
        self.calls += 1
        if self.fail:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return super().accept()


@pytest.mark.slow
def test_out_of_descriptors_pauses_accepting_instead_of_spinning(tmp_path):
    """accept() failing with EMFILE leaves the listener readable: the relay
    stops watching it for a moment (one log line), then serves again."""
    up = Upstream("echo")
    path = str(tmp_path / "proxy.sock")
    listener = FailingListener(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    lines: list[str] = []
    r = Relay(listener, up.addr, 8, say=lines.append, tick_s=0.05)
    t = threading.Thread(target=r.run, daemon=True)
    t.start()
    try:
        s = connect(path)                       # waits in the backlog: the listener stays readable
        time.sleep(1.0)
        assert listener.calls <= 5, f"the relay spun on its listener ({listener.calls} accept calls in 1s)"
        assert len(lines) == 1 and lines[0].startswith("cannot accept connections (Too many open files")
        listener.fail = False                   # descriptors back: the waiting one is served
        s.sendall(b"x")
        assert s.recv(1) == b"x"
    finally:
        r.stop()
        t.join(5)
        r.close()
        listener.close()


def _pids_running(marker: str) -> list[int]:
    """Processes whose command line holds `marker` (a test's own temporary path)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in Path(f"/proc/{d}/cmdline").read_bytes():
                    pids.append(int(d))
    return pids


def test_the_forwarder_program_relays_its_port_to_a_unix_socket_from_one_thread(tmp_path):
    """relayforward.py's program as a sandbox runs it (here on the host): it
    returns once it listens, a second start is a no-op, and 200 connections
    through it are relayed by one thread."""
    sock = str(tmp_path / "relay.sock")
    Upstream("echo", path=sock)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    program = relayforward.source(port, sock)
    subprocess.run([sys.executable, "-c", program], check=True, timeout=30)
    held: list[socket.socket] = []
    try:
        subprocess.run([sys.executable, "-c", program], check=True, timeout=30)   # already listening: exit 0
        (pid,) = _pids_running(sock)
        for i in range(200):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"%d" % i)
            held.append(s)
        for i, s in enumerate(held):
            assert s.recv(10) == b"%d" % i
        assert len(os.listdir(f"/proc/{pid}/task")) == 1
    finally:
        for s in held:
            s.close()
        for pid in _pids_running(sock):
            os.kill(pid, 9)


def test_a_unix_upstream_with_a_full_backlog_is_waited_for_not_dropped(tmp_path):
    """A Unix socket whose backlog is full refuses a non-blocking connect
    (EAGAIN) where a blocking one would wait: the relay tries again until
    the upstream accepts, and the client's connection goes through."""
    sock = str(tmp_path / "relay.sock")
    up = Upstream("echo", path=sock, backlog=1, accepting=False)
    fillers = []
    while True:                                # fill the upstream's backlog
        f = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        f.setblocking(False)
        if f.connect_ex(sock) != 0:
            f.close()
            break
        fillers.append(f)
    listener = socket.create_server(("127.0.0.1", 0))
    r = Relay(listener, sock, 8, tick_s=0.05)
    t = threading.Thread(target=r.run, daemon=True)
    t.start()
    try:
        client = socket.create_connection(listener.getsockname(), timeout=5)
        client.sendall(b"x")
        assert not closed_at_once(client, within=0.5)     # waiting, not dropped
        assert len(r.backlogged) == 1
        up.accepting.set()                                 # the upstream accepts again
        assert client.recv(1) == b"x"
        assert not r.backlogged
    finally:
        r.stop()
        t.join(5)
        r.close()
        listener.close()
        for f in fillers:
            f.close()
