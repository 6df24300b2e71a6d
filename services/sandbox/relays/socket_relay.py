# afe-socket-relay: its source also runs INSIDE proxy containers and sandboxes (as their own users).
"""A relay of stream connections in one thread: every connection accepted
on a listening socket is copied, byte for byte and both ways as the bytes
come, to a new connection of its own to an upstream address (TCP, or a Unix
socket's path).

Two programs are this file's source plus a few lines that call `Relay`:
the proxy container's main process for egress without an interface
(egress/over_socket.py: the ticket's Unix socket to squid on the container's
loopback) and the forwarders in a sandbox (forward.py: the sandbox's
loopback to the egress proxy's socket or to the model relay's). So it uses
the standard library only and does nothing when imported.

One selector loop relays all connections, with no thread per connection: a
pids limit (the proxy container's 128, a sandbox's) cannot be reached by
opening connections, and the loop that accepts is the loop that relays, so
it cannot die while the others go on. At most `max_connections` are relayed
at once; one more is closed as soon as it is accepted, which a client sees
as an empty answer, and the refusals are counted on stderr once per
interval, never one line per connection. A direction holds at most one read
of CHUNK bytes while its destination is not ready for it, and stops reading
meanwhile, so a slow reader holds memory only up to max_connections * 2 * CHUNK.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import sys
import time
from collections.abc import Callable

CHUNK = 65536
PUMP_READS = 8              # reads of one connection per wakeup, while its destination keeps up
LOG_EVERY_S = 60.0          # refusals: the first is logged at once, then at most one line per interval
ACCEPT_PAUSE_S = 0.5        # out of descriptors or memory: stop accepting for this long
TICK_S = 1.0
RETRY_S = 0.01              # a Unix upstream's full backlog: tried again this often
UNIX_BACKLOG_WAIT_S = 5.0   # ... for this long, as a blocking connect would wait
_ACCEPT_RETRY = (errno.ECONNABORTED, errno.EPROTO, errno.EINTR)


def log(message: str) -> None:
    sys.stderr.write(f"afe socket relay: {message}\n")
    sys.stderr.flush()


class Stream:
    """One direction of a connection: bytes read from `src` not yet written to `dst`."""

    __slots__ = ("done", "dst", "eof", "pending", "src")

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src = src
        self.dst = dst
        self.pending = b""
        self.eof = False         # src has ended
        self.done = False        # ... and everything it sent is written, dst's writing side shut


class Conn:
    """A client's connection and its own connection to the upstream."""

    __slots__ = ("client", "closed", "connecting", "down", "masks", "up", "upstream")

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.up = Stream(client, upstream)
        self.down = Stream(upstream, client)
        self.connecting = True
        self.closed = False
        self.masks = {client: 0, upstream: 0}


class Relay:
    """Relays each connection accepted on `listener` (listening) to a new
    connection to `upstream` (a (host, port) or a Unix socket's path), in one
    thread (`run`)."""

    def __init__(self, listener: socket.socket, upstream: tuple[str, int] | str, max_connections: int,
                 log_every_s: float = LOG_EVERY_S, say: Callable[[str], None] = log, tick_s: float = TICK_S) -> None:
        self.listener = listener
        self.upstream = upstream
        self.max_connections = max_connections
        self.log_every_s = log_every_s
        self.say = say
        self.tick_s = tick_s
        self.sel = selectors.DefaultSelector()
        self.conns: set[Conn] = set()
        self.backlogged: dict[Conn, float] = {}   # Unix upstream with a full backlog: retried until then
        self.refused = 0             # refused since the last line about it
        self.refused_total = 0
        self.refused_logged_at: float | None = None
        self.accept_paused_until = 0.0
        self.accept_errors = 0
        self.accept_logged_at: float | None = None
        self.stopping = False
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, None)

    # ---- the loop ---------------------------------------------------------------

    def run(self, tick: Callable[[], None] | None = None) -> None:
        """Serve until `stop()`; `tick()` is called every `tick_s` or so."""
        next_tick = time.monotonic() + self.tick_s
        while not self.stopping:
            for key, mask in self.sel.select(RETRY_S if self.backlogged else self.tick_s):
                if key.data is None:
                    self.accept()
                else:
                    self.ready(key.data, key.fileobj, mask)  # type: ignore[arg-type]
            now = time.monotonic()
            if self.backlogged:
                self.retry_backlogged(now)
            if now >= next_tick:
                next_tick = now + self.tick_s
                self.periodic(now)
                if tick is not None:
                    tick()

    def stop(self) -> None:
        self.stopping = True

    def close(self) -> None:
        for conn in list(self.conns):
            self.drop(conn)
        self.sel.close()

    def periodic(self, now: float) -> None:
        if self.refused and (self.refused_logged_at is None or now - self.refused_logged_at >= self.log_every_s):
            self.log_refused(now)
        if self.accept_paused_until and now >= self.accept_paused_until:
            self.accept_paused_until = 0.0
            self.sel.register(self.listener, selectors.EVENT_READ, None)

    # ---- accepting ----------------------------------------------------------------

    def accept(self) -> None:
        for _ in range(64):
            try:
                client, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _ACCEPT_RETRY:
                    continue
                self.pause_accepting(exc)
                return
            if len(self.conns) >= self.max_connections:
                client.close()
                self.refuse()
                continue
            self.open(client)

    def refuse(self) -> None:
        self.refused += 1
        self.refused_total += 1
        now = time.monotonic()
        if self.refused_logged_at is None or now - self.refused_logged_at >= self.log_every_s:
            self.log_refused(now)

    def log_refused(self, now: float) -> None:
        since = "" if self.refused_logged_at is None else f" in the last {now - self.refused_logged_at:.0f}s"
        self.say(f"refused {self.refused} connection(s){since}: {len(self.conns)} are open, the limit of "
                 f"{self.max_connections} at once ({self.refused_total} refused in all); the sandbox must "
                 "close connections it holds open to make new ones")
        self.refused = 0
        self.refused_logged_at = now

    def pause_accepting(self, exc: OSError) -> None:
        """Out of descriptors or memory: a readable listener would spin, so wait."""
        self.accept_errors += 1
        now = time.monotonic()
        if self.accept_logged_at is None or now - self.accept_logged_at >= self.log_every_s:
            self.say(f"cannot accept connections ({exc.strerror or exc}; {self.accept_errors} time(s)), "
                     f"{len(self.conns)} open: pausing {ACCEPT_PAUSE_S}s")
            self.accept_logged_at = now
            self.accept_errors = 0
        if not self.accept_paused_until:
            self.sel.unregister(self.listener)
        self.accept_paused_until = now + ACCEPT_PAUSE_S

    def open(self, client: socket.socket) -> None:
        unix = isinstance(self.upstream, str)
        try:
            upstream = socket.socket(socket.AF_UNIX if unix else socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:
            client.close()
            self.pause_accepting(exc)
            return
        client.setblocking(False)
        upstream.setblocking(False)
        for sock in (client, upstream):
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Conn(client, upstream)
        self.conns.add(conn)
        self.connect(conn, time.monotonic() + UNIX_BACKLOG_WAIT_S)

    def connect(self, conn: Conn, wait_until: float) -> None:
        """Start (or retry) the upstream connection. A Unix socket whose
        backlog is full answers EAGAIN (a blocking connect would wait): it is
        tried again every RETRY_S until `wait_until`."""
        code = conn.upstream.connect_ex(self.upstream)
        if code == errno.EAGAIN and isinstance(self.upstream, str) and time.monotonic() < wait_until:
            self.backlogged[conn] = wait_until
            return
        self.backlogged.pop(conn, None)
        if code == 0:
            conn.connecting = False
        elif code != errno.EINPROGRESS:
            self.drop(conn)
            return
        self.update(conn)

    def retry_backlogged(self, now: float) -> None:
        for conn, until in list(self.backlogged.items()):
            if conn.closed:
                self.backlogged.pop(conn, None)
            else:
                self.connect(conn, until)

    # ---- relaying -----------------------------------------------------------------

    def ready(self, conn: Conn, sock: socket.socket, mask: int) -> None:
        if conn.closed:
            return
        try:
            if sock is conn.upstream and conn.connecting:
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, os.strerror(err))
                conn.connecting = False
            else:
                if mask & selectors.EVENT_WRITE:
                    self.flush(conn.up if sock is conn.upstream else conn.down)
                if mask & selectors.EVENT_READ:
                    self.pump(conn.up if sock is conn.client else conn.down)
        except OSError:
            self.drop(conn)
            return
        if conn.up.done and conn.down.done:
            self.drop(conn)
        else:
            self.update(conn)

    def pump(self, s: Stream) -> None:
        """`s.src` is readable and nothing of it is pending: read and pass it
        on, a few reads in a row while the destination takes it all (a bulk
        transfer then costs a wakeup per PUMP_READS reads, other connections
        still get their turn)."""
        for _ in range(PUMP_READS):
            try:
                data = s.src.recv(CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            if not data:
                s.eof = True
                self.flush(s)
                return
            s.pending = data
            self.flush(s)
            if s.pending or len(data) < CHUNK:
                return

    def flush(self, s: Stream) -> None:
        """Write what `s` holds; once its source ended and all is written, shut dst's writing side."""
        if s.pending:
            try:
                n = s.dst.send(s.pending)
            except (BlockingIOError, InterruptedError):
                n = 0
            s.pending = s.pending[n:]
        if s.eof and not s.pending and not s.done:
            s.done = True
            with contextlib.suppress(OSError):
                s.dst.shutdown(socket.SHUT_WR)

    def update(self, conn: Conn) -> None:
        """Register each socket for what it waits for now."""
        up, down = conn.up, conn.down
        if conn.connecting:
            want = {conn.client: 0, conn.upstream: selectors.EVENT_WRITE}
        else:
            want = {
                conn.client: (selectors.EVENT_READ if not up.eof and not up.pending else 0)
                | (selectors.EVENT_WRITE if down.pending else 0),
                conn.upstream: (selectors.EVENT_READ if not down.eof and not down.pending else 0)
                | (selectors.EVENT_WRITE if up.pending else 0),
            }
        for sock, mask in want.items():
            old = conn.masks[sock]
            if mask == old:
                continue
            if not old:
                self.sel.register(sock, mask, conn)
            elif not mask:
                self.sel.unregister(sock)
            else:
                self.sel.modify(sock, mask, conn)
            conn.masks[sock] = mask

    def drop(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self.backlogged.pop(conn, None)
        for sock in (conn.client, conn.upstream):
            if conn.masks[sock]:
                self.sel.unregister(sock)
            sock.close()
        self.conns.discard(conn)
