"""Exec (streaming, exit code, timeout, output cap, cwd, stdin) and the
interactive Process stream (EOF, kill), plus the link-secret guard."""

from __future__ import annotations

import os
import queue
import secrets
import subprocess
import threading

import grpc
import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.common.rpc.links import new_secret
from tests.sandbox.conftest import run, sync_stub

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]


def test_exec_streams_stdout_stderr_and_exit_code(stub, plain_sandbox):
    r = run(stub, plain_sandbox, "echo out; echo err >&2; exit 7")
    assert (r.code, r.stdout, r.stderr) == (7, b"out\n", b"err\n")
    assert not r.exit.timed_out and not r.exit.truncated


def test_exec_streams_chunks_before_exit(stub, plain_sandbox):
    events = stub.Exec(pb.ExecRequest(ticket_id=plain_sandbox, argv=["bash", "-c", "echo first; sleep 2; echo second"]),
                       timeout=60)
    first = next(iter(events))
    assert first.stdout == b"first\n"          # arrived while the command still runs
    rest = list(events)
    assert rest[-1].exit.code == 0


def test_exec_argv_is_not_a_shell(stub, plain_sandbox):
    r = run(stub, plain_sandbox, ["echo", "$(id)", ";", "ls"])
    assert r.stdout == b"$(id) ; ls\n"


def test_exec_timeout_kills_the_process_group(stub, plain_sandbox):
    r = run(stub, plain_sandbox, "sleep 300 & sleep 300; echo never", timeout_ms=500)
    assert r.code == -1 and r.exit.timed_out and b"never" not in r.stdout
    left = run(stub, plain_sandbox, "ps -eo args | grep -c '^sleep 300' || true")
    assert left.stdout.strip() == b"0"


def test_exec_output_cap_truncates_with_marker(stub, plain_sandbox):
    r = run(stub, plain_sandbox, "head -c 10000000 /dev/zero | tr '\\0' x", output_cap_bytes=4096)
    assert len(r.stdout) == 4096 and r.exit.truncated
    assert b"output truncated after 4096 bytes" in r.stderr
    assert r.code == 0


def test_exec_cwd_is_confined_to_workspace(stub, plain_sandbox):
    run(stub, plain_sandbox, "mkdir -p /workspace/sub")
    assert run(stub, plain_sandbox, "pwd", cwd="sub").stdout == b"/workspace/sub\n"
    assert run(stub, plain_sandbox, "pwd").stdout == b"/workspace\n"
    for bad in ("../etc", "/etc", "sub/../../etc", "sub//x"):
        with pytest.raises(grpc.RpcError) as ei:
            run(stub, plain_sandbox, "pwd", cwd=bad)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_exec_stdin(stub, plain_sandbox):
    assert run(stub, plain_sandbox, ["wc", "-c"], stdin=b"x" * 100000).stdout.strip() == b"100000"


def test_exec_unknown_ticket_is_not_found(stub):
    with pytest.raises(grpc.RpcError) as ei:
        run(stub, "no-such-ticket", "true")
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND


class Proc:
    """Drive a Process stream from a test: send() inputs, read outputs."""

    def __init__(self, stub, ticket, argv):
        self.q: queue.Queue = queue.Queue()
        self.q.put(pb.ProcessInput(start=pb.ProcessStart(ticket_id=ticket, argv=argv)))
        self.out: queue.Queue = queue.Queue()
        self.call = stub.Process(iter(self.q.get, None), timeout=60)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for o in self.call:
                self.out.put(o)
        finally:
            self.out.put(None)

    def send(self, **kw):
        self.q.put(pb.ProcessInput(**kw))

    def next(self, timeout=30):
        return self.out.get(timeout=timeout)

    def line(self):
        buf = b""
        while not buf.endswith(b"\n"):
            o = self.next()
            assert o is not None and o.WhichOneof("output") == "stdout", o
            buf += o.stdout
        return buf

    def until_exit(self):
        chunks = []
        while (o := self.next()) is not None:
            if o.WhichOneof("output") == "exit":
                return b"".join(chunks), o.exit
            if o.WhichOneof("output") == "stdout":
                chunks.append(o.stdout)
        raise AssertionError("stream ended without exit")


def test_process_is_interactive_and_ends_on_close_stdin(stub, plain_sandbox):
    p = Proc(stub, plain_sandbox, ["python3", "-u", "-c",
                                   "import sys\nfor l in sys.stdin: print('echo:' + l.strip(), flush=True)\nprint('bye')"])
    assert p.next().started
    for i in range(3):
        p.send(stdin=f"line{i}\n".encode())
        assert p.line() == f"echo:line{i}\n".encode()    # a reply per line: truly bidirectional
    p.send(close_stdin=True)
    out, ex = p.until_exit()
    assert out == b"bye\n" and ex.code == 0
    p.q.put(None)


def test_process_kill(stub, plain_sandbox):
    p = Proc(stub, plain_sandbox, ["sleep", "600"])
    assert p.next().started
    p.send(kill=True)
    _, ex = p.until_exit()
    assert ex.code != 0
    p.q.put(None)
    assert run(stub, plain_sandbox, "pgrep -c -f '^sleep 600' || true").stdout.strip() == b"0"


def test_process_first_message_must_be_start(stub):
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Process(iter([pb.ProcessInput(stdin=b"x")]), timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_freeze_pauses_and_thaws(stub, plain_sandbox):
    stub.Freeze(pb.FreezeRequest(ticket_id=plain_sandbox, frozen=True))
    try:
        states = {s.ticket_id: s.state for s in stub.ListSandboxes(pb.ListSandboxesRequest()).sandboxes}
        assert states[plain_sandbox] == "paused"
        with pytest.raises(grpc.RpcError) as ei:
            run(stub, plain_sandbox, "true")
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        stub.Freeze(pb.FreezeRequest(ticket_id=plain_sandbox, frozen=False))
    assert run(stub, plain_sandbox, "echo thawed").stdout == b"thawed\n"


def test_only_the_scheduler_link_secret_is_accepted(broker, plain_sandbox):
    for secret in (None, new_secret()):
        ch, bad = sync_stub(broker.socket, secret)
        with pytest.raises(grpc.RpcError) as ei:
            run(bad, plain_sandbox, "true")
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
        ch.close()
    ch, good = sync_stub(broker.socket, broker.secret)      # positive control
    assert run(good, plain_sandbox, "echo ok").stdout == b"ok\n"
    ch.close()


def test_exec_cancelled_by_the_caller_kills_the_process(stub, plain_sandbox):
    call = stub.Exec(pb.ExecRequest(ticket_id=plain_sandbox, argv=["bash", "-c", "echo go; exec sleep 301"]),
                     timeout=60)
    assert next(iter(call)).stdout == b"go\n"
    assert run(stub, plain_sandbox, "pgrep -c -f '^sleep 301' || true").stdout.strip() == b"1"   # control
    call.cancel()
    for _ in range(100):
        if run(stub, plain_sandbox, "pgrep -c -f '^sleep 301' || true").stdout.strip() == b"0":
            break
    assert run(stub, plain_sandbox, "pgrep -c -f '^sleep 301' || true").stdout.strip() == b"0"


def test_exec_timeout_kills_from_inside_when_the_host_may_not(stub, plain_sandbox, monkeypatch, runtime):
    """A broker not running as root cannot signal the sandbox uid's processes:
    it kills the process group from inside the sandbox instead. (A gVisor
    command is never killed from the host: its processes live in gVisor's
    kernel, so it is always killed from inside, by the pid it said.)"""
    from services.sandbox.commands import execs

    refused = []

    def denied(pid, sig):
        refused.append(pid)
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(execs.os, "killpg", denied)
    r = run(stub, plain_sandbox, "sleep 302 & sleep 302", timeout_ms=500)
    assert r.exit.timed_out and (bool(refused) == (runtime == "runc"))   # the host-side kill was refused
    assert run(stub, plain_sandbox, "pgrep -c -f '^sleep 302' || true").stdout.strip() == b"0"


def test_r4_exec_runs_inside_the_sandbox_not_on_the_host(stub, plain_sandbox):
    marker = f"/tmp/afe-r4-{os.getpid()}-{secrets.token_hex(6)}"
    r = run(stub, plain_sandbox, f"touch {marker} && cat /proc/1/cmdline | tr '\\0' ' ' && echo && id -u && hostname")
    assert r.code == 0
    init_cmd, uid, host = r.stdout.decode().splitlines()
    assert "docker-init" in init_cmd and "sleep infinity" in init_cmd     # PID 1 is the container's init
    assert uid == "10001" and host == "sandbox"
    assert not os.path.exists(marker)              # the write happened in the container's /tmp
    subprocess.run(["touch", marker], check=True)  # positive control: the same command on the host does
    try:
        assert os.path.exists(marker)
    finally:
        os.unlink(marker)
