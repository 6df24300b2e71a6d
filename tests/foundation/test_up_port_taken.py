"""A port already taken (issue 35): `afe up` checks every port it will listen on
before anything starts, and names the port, what it is for, the process that
holds it and the flag that moves it. A child that still meets a taken port
(taken after the check) says the same in one line, without a traceback.

Positive control: the sockets these tests hold really do refuse another bind
on their port, which is what used to end in the gateway's
`OSError: [Errno 98] Address already in use` traceback and "the gateway
process exited with code 1 before it was ready".
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common import demo
from services.common.errors import ConfigError
from services.launcher.ports import check_ports, planned

from .launcher_support import ROOT, base_env

SERVICES = ("sandbox", "credentials", "scheduler", "gateway")


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A port on 127.0.0.1 that this process listens on, as another program would."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def refuses_bind(port: int) -> bool:
    """Positive control: a server binding the port now gets EADDRINUSE."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def our_name() -> str:
    return Path("/proc/self/comm").read_text().strip()


def test_a_taken_ui_port_is_named_with_its_holder_and_the_flag():
    with held_port() as port:
        assert refuses_bind(port)
        with pytest.raises(ConfigError) as info:
            check_ports(planned(f"127.0.0.1:{port}", "127.0.0.1", dict.fromkeys(SERVICES, 0)))
    text = str(info.value)
    assert f"127.0.0.1:{port} (the web UI and /rpc): held by pid {os.getpid()} ({our_name()})" in text
    assert f"--listen 127.0.0.1:{port + 1} (and AFE_URL=http://127.0.0.1:{port + 1} for the CLI)" in text
    # Control: the same plan passes once the port is free again.
    check_ports(planned(f"127.0.0.1:{port}", "127.0.0.1", dict.fromkeys(SERVICES, 0)))


def test_a_taken_ops_port_names_the_service_and_its_flag():
    with held_port() as port, pytest.raises(ConfigError) as info:
        check_ports(planned("127.0.0.1:0", "127.0.0.1", {**dict.fromkeys(SERVICES, 0), "scheduler": port}))
    text = str(info.value)
    assert f"127.0.0.1:{port} (the scheduler process's /livez, /readyz and /metrics)" in text
    assert "--ops-port scheduler=PORT, or --ops-port 0 for free ports" in text


def test_one_ops_port_for_every_service_is_refused_before_any_bind():
    with held_port() as port:
        pass        # a port free now: only the four services' own collision can stop them
    with pytest.raises(ConfigError) as info:
        check_ports(planned("127.0.0.1:0", "127.0.0.1", dict.fromkeys(SERVICES, port)))
    text = str(info.value)
    assert text.count("also asked for the sandbox process's") == 3, text


def test_afe_up_with_taken_ports_starts_nothing_and_says_which(tmp_path):
    cfg = demo.materialize(tmp_path / "cfg")
    with held_port() as ui, held_port() as ops:
        r = subprocess.run([sys.executable, "-m", "services.cli.main", "up", "--config", str(cfg),
                            "--data", str(tmp_path / "data"), "--run", str(tmp_path / "run"), "--no-images",
                            "--listen", f"127.0.0.1:{ui}", "--ops-port", "0", "--ops-port", f"gateway={ops}"],
                           cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=60, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "these ports are already in use, so afe started nothing" in out
    assert f"127.0.0.1:{ui} (the web UI and /rpc): held by pid {os.getpid()}" in out
    assert f"127.0.0.1:{ops} (the gateway process's /livez, /readyz and /metrics): held by pid" in out
    assert "Traceback" not in out and "started sandbox" not in out
    assert not (tmp_path / "run").exists()


def test_a_child_that_meets_a_taken_port_says_so_in_one_line(tmp_path):
    """The gateway started on its own, as `afe up` starts it, after the check passed:
    first its UI port taken, then its ops port."""
    token = tmp_path / "ui-token"
    token.write_text("t" * 40 + "\n")
    token.chmod(0o600)
    base = [sys.executable, "-m", "gateway.main", "--config", str(tmp_path), "--data", str(tmp_path / "d"),
            "--run", str(tmp_path / "r"), "--token-file", str(token)]
    with held_port() as port:
        assert refuses_bind(port)
        for extra, flag in ((["--listen", f"127.0.0.1:{port}", "--ops-port", "0"], "--listen HOST:PORT"),
                            (["--listen", "127.0.0.1:0", "--ops-port", str(port)], "--ops-port")):
            r = subprocess.run([*base, *extra], cwd=ROOT, env=base_env(), capture_output=True, text=True,
                               timeout=60, check=False)
            assert r.returncode == 2, r.stderr
            assert "Traceback" not in r.stderr, r.stderr
            assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and flag in r.stderr, r.stderr
