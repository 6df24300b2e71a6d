# afe-supervisor: runs INSIDE a sandbox, as the sandbox user (never on the host).
"""The command supervisor that runs inside a sandbox (see command_supervisor.py).

The sandbox broker starts this file's source once per sandbox with one
`docker exec` (as the sandbox user, no extra environment, stdin attached) and
then sends it commands over that exec's stdin; it answers on stdout. It has
exactly the privileges of any other process in the sandbox, and nothing it
holds is worth more: a declared environment value (R9) passes through it to
the one child that asked for it and is not kept.

Frames both ways: a header `>BII` (type, command id, payload length) then
the payload.
  broker -> here: S start (JSON {argv, cwd, env, stdin}), I stdin bytes,
                  E close stdin, K kill the process group, C output credit
  here -> broker: H hello, P started (ns pid), O stdout, R stderr,
                  W stdin taken (bytes written to the child's pipe, or
                  dropped because it is closed),
                  X exit (signed code, 128+N for a signal; 126 when the
                  program could not be started, as `docker exec` answers)

Output is flow controlled: a command gets WINDOW bytes of credit and more
only as the broker consumes it, so one chatty command cannot make the
broker buffer without bound (a child that writes more blocks on its pipe).
Stdin is too, the other way: the broker sends at most IN_WINDOW bytes a
command has not taken yet (W), so a child that stops reading its stdin holds
at most that here and its writer on the broker's side waits, as it would on
an exec's stream; more than that is a broken broker and ends the supervisor.
When the broker's stream closes, every command's process group is killed
and the supervisor exits.
"""

import contextlib
import json
import os
import selectors
import signal
import struct
import subprocess
import sys
import time

# Types are written as comments: this source runs unchanged on whatever python3 the
# sandbox image has (3.6 too), so it neither annotates nor imports typing at run time.
MYPY = False
if MYPY:
    from typing import Any  # noqa: F401 (read by mypy in the type comments)

HDR = struct.Struct(">BII")
CODE = struct.Struct(">i")
WINDOW = 256 * 1024
IN_WINDOW = 256 * 1024
MAX_IN = 1 << 20
READ = 65536
P_KIND = ord("P")
# A command's "started" frame waits at most this long for the frames that
# follow it, so a short command's start, output and exit reach the broker in
# one write (one trip through the engine instead of two). The broker does not
# depend on it: a supervisor killed before it sent a command's pid has that
# command's session swept from inside (command_supervisor.py, SWEEP).
HOLD_STARTED_S = 0.002


def write_all(buf):
    # type: (bytes) -> None
    view = memoryview(buf)
    while view:
        n = os.write(1, view)
        view = view[n:]


class Cmd:
    def __init__(self, cid, proc):
        # type: (int, subprocess.Popen[bytes]) -> None
        self.cid = cid
        self.proc = proc
        self.pid = proc.pid
        self.credit = WINDOW
        self.code = None  # type: int | None
        self.fds = {}  # type: dict[int, str]  # fd -> kind (O or R)
        self.paused = set()  # type: set[int]  # output fds waiting for credit
        self.stdin_fd = proc.stdin.fileno() if proc.stdin else -1
        self.pending = bytearray()
        self.eof = False
        self.pidfd = -1


class Supervisor:
    def __init__(self):
        # type: () -> None
        self.sel = selectors.DefaultSelector()
        self.cmds = {}  # type: dict[int, Cmd]
        self.base_env = dict(os.environ)
        self.inbuf = bytearray()
        self.out = []  # type: list[bytes]  # frames of this turn, written together at its end
        self.hold_until = None  # type: float | None  # only "started" frames wait: until then, or until another frame comes
        self.urgent = False

    def send(self, kind, cid, payload=b""):
        # type: (int, int, bytes) -> None
        self.out.append(HDR.pack(kind, cid, len(payload)) + payload)
        if kind == P_KIND:
            if self.hold_until is None:
                self.hold_until = time.monotonic() + HOLD_STARTED_S
        else:
            self.urgent = True

    def flush(self):
        # type: () -> None
        if self.out:
            buf = b"".join(self.out)
            self.out.clear()
            write_all(buf)
        self.hold_until = None
        self.urgent = False

    def run(self):
        # type: () -> None
        os.set_blocking(0, False)
        self.sel.register(0, selectors.EVENT_READ, ("ctl", None))
        self.send(ord("H"), 0, b"afe-supervisor 2")
        self.flush()
        while True:
            polled = [c for c in self.cmds.values() if c.pidfd < 0 and c.code is None]
            timeout = 0.05 if polled else None
            if self.hold_until is not None:
                left = max(0.0, self.hold_until - time.monotonic())
                timeout = left if timeout is None else min(timeout, left)
            for key, _mask in self.sel.select(timeout):
                what, cmd = key.data
                if what == "ctl":
                    if not self.control():
                        self.shutdown()
                        return
                elif what == "out":
                    self.output(cmd, key.fd)
                elif what == "in":
                    self.feed(cmd)
                elif what == "exit":
                    self.reap(cmd)
            for cmd in polled:          # no pidfd (an old kernel): poll
                if cmd.code is None and cmd.proc.poll() is not None:
                    self.reap(cmd)
            if self.urgent or (self.hold_until is not None and time.monotonic() >= self.hold_until):
                self.flush()

    # -- messages from the broker ------------------------------------------
    def control(self):
        # type: () -> bool
        try:
            data = os.read(0, READ)
        except BlockingIOError:
            return True
        if not data:
            return False
        self.inbuf += data
        while len(self.inbuf) >= HDR.size:
            kind, cid, n = HDR.unpack_from(self.inbuf)
            if n > MAX_IN:
                return False
            if len(self.inbuf) < HDR.size + n:
                break
            payload = bytes(self.inbuf[HDR.size:HDR.size + n])
            del self.inbuf[:HDR.size + n]
            if not self.message(chr(kind), cid, payload):
                return False
        return True

    def message(self, kind, cid, payload):
        # type: (str, int, bytes) -> bool
        cmd = self.cmds.get(cid)
        if kind == "S" and cmd is None:
            self.start(cid, json.loads(payload))
        elif cmd is None:
            return True
        elif kind == "I":
            if cmd.eof or cmd.stdin_fd < 0:
                if payload:
                    self.send(ord("W"), cid, CODE.pack(len(payload)))    # nowhere to go: dropped
            elif len(cmd.pending) + len(payload) > IN_WINDOW:
                return False                    # past the stdin credit: not the broker's protocol
            else:
                cmd.pending += payload
                self.feed(cmd)
        elif kind == "E":
            cmd.eof = True
            self.feed(cmd)
        elif kind == "K":
            with contextlib.suppress(OSError):
                os.killpg(cmd.pid, signal.SIGKILL)
        elif kind == "C":
            cmd.credit += CODE.unpack(payload)[0]
            for fd in list(cmd.paused):
                cmd.paused.discard(fd)
                self.sel.register(fd, selectors.EVENT_READ, ("out", cmd))
        return True

    def start(self, cid, spec):
        # type: (int, dict[str, Any]) -> None
        env = dict(self.base_env)
        for entry in spec.get("env", []):
            k, _, v = entry.partition("=")
            env[k] = v
        try:
            proc = subprocess.Popen(
                spec["argv"], cwd=spec["cwd"], env=env, start_new_session=True, close_fds=True,
                stdin=subprocess.PIPE if spec.get("stdin") else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as exc:
            what = "chdir to " + spec["cwd"] if isinstance(exc, NotADirectoryError) else spec["argv"][0]
            self.send(ord("R"), cid, f"afe: cannot start {what}: {exc.strerror}\n".encode())
            self.send(ord("X"), cid, CODE.pack(126))
            return
        # P first, before anything else of this command (held for at most
        # HOLD_STARTED_S, so it can share a write with what follows)
        self.send(P_KIND, cid, CODE.pack(proc.pid))
        cmd = Cmd(cid, proc)
        self.cmds[cid] = cmd
        for f, kind in ((proc.stdout, "O"), (proc.stderr, "R")):
            assert f is not None        # both are pipes
            os.set_blocking(f.fileno(), False)
            cmd.fds[f.fileno()] = kind
            self.sel.register(f.fileno(), selectors.EVENT_READ, ("out", cmd))
        if cmd.stdin_fd >= 0:
            os.set_blocking(cmd.stdin_fd, False)
        try:
            cmd.pidfd = os.pidfd_open(proc.pid)
            self.sel.register(cmd.pidfd, selectors.EVENT_READ, ("exit", cmd))
        except (AttributeError, OSError):
            cmd.pidfd = -1

    # -- the children ---------------------------------------------------------
    def feed(self, cmd):
        # type: (Cmd) -> None
        if cmd.stdin_fd < 0:
            return
        taken = 0
        try:
            while cmd.pending:
                n = os.write(cmd.stdin_fd, cmd.pending[:READ])
                del cmd.pending[:n]
                taken += n
        except BlockingIOError:
            pass
        except OSError:                 # the child closed its stdin: the rest is dropped
            taken += len(cmd.pending)
            cmd.pending.clear()
            cmd.eof = True
        if taken:
            self.send(ord("W"), cmd.cid, CODE.pack(taken))     # credit back to the broker's writer
        registered = cmd.stdin_fd in self.sel.get_map()
        if cmd.pending and not registered:
            self.sel.register(cmd.stdin_fd, selectors.EVENT_WRITE, ("in", cmd))
        elif not cmd.pending:
            if registered:
                self.sel.unregister(cmd.stdin_fd)
            if cmd.eof:
                assert cmd.proc.stdin is not None      # stdin_fd >= 0: a pipe
                cmd.proc.stdin.close()
                cmd.stdin_fd = -1

    def output(self, cmd, fd):
        # type: (Cmd, int) -> None
        if cmd.credit <= 0:
            self.sel.unregister(fd)
            cmd.paused.add(fd)
            return
        try:
            data = os.read(fd, min(READ, cmd.credit))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            cmd.credit -= len(data)
            self.send(ord(cmd.fds[fd]), cmd.cid, data)
            return
        self.sel.unregister(fd)
        del cmd.fds[fd]
        self.finish(cmd)

    def reap(self, cmd):
        # type: (Cmd) -> None
        if cmd.code is not None:
            return
        if cmd.pidfd >= 0:
            self.sel.unregister(cmd.pidfd)
            os.close(cmd.pidfd)
            cmd.pidfd = -1
        code = cmd.proc.wait()
        cmd.code = 128 - code if code < 0 else code
        self.finish(cmd)

    def finish(self, cmd):
        # type: (Cmd) -> None
        """A command is over when its process has exited and its output is
        closed (as a `docker exec` stream is)."""
        if cmd.code is None or cmd.fds or cmd.paused:
            return
        if cmd.stdin_fd >= 0:
            if cmd.stdin_fd in self.sel.get_map():
                self.sel.unregister(cmd.stdin_fd)
            assert cmd.proc.stdin is not None          # stdin_fd >= 0: a pipe
            cmd.proc.stdin.close()
            cmd.stdin_fd = -1
        for f in (cmd.proc.stdout, cmd.proc.stderr):
            assert f is not None                        # both are pipes
            f.close()
        del self.cmds[cmd.cid]
        self.send(ord("X"), cmd.cid, CODE.pack(cmd.code))

    def shutdown(self):
        # type: () -> None
        for cmd in self.cmds.values():
            with contextlib.suppress(OSError):
                os.killpg(cmd.pid, signal.SIGKILL)


def main():
    # type: () -> None
    with contextlib.suppress(ImportError, OSError, AttributeError):
        import ctypes
        # Not dumpable: another process of the sandbox user can neither
        # ptrace this one nor open its /proc/PID/fd (its stream to the broker).
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)      # PR_SET_DUMPABLE, 0
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):
        Supervisor().run()
    sys.exit(0)


if __name__ == "__main__":
    main()
