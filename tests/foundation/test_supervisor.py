"""The launcher's Supervisor with small real child processes: back-off on a
crash loop, link secrets only on the inherited fd, SIGKILL after the grace."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import pytest

from services.common.rpc.links import LinkSecrets, new_secret
from services.launcher.process_supervisor import ChildSpec, Supervisor

from .launcher_support import alive

pytestmark = pytest.mark.timeout(60)

ENV = {"PATH": os.environ["PATH"]}

# A child that follows the convention: reads its link fd, reports ready with a
# digest of what it read, then sleeps.
CHILD = r"""
import hashlib, json, os, signal, sys, time
args = sys.argv[1:]
link_fd = int(args[args.index("--link-fd") + 1]); status_fd = int(args[args.index("--status-fd") + 1])
if "ignore-term" in args:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
data = b""
while chunk := os.read(link_fd, 65536):
    data += chunk
os.close(link_fd)
os.write(status_fd, json.dumps({"pid": os.getpid(), "links": hashlib.sha256(data).hexdigest()}).encode() + b"\n")
os.close(status_fd)
time.sleep(60)
"""


def spec(*extra: str, links: LinkSecrets | None = None) -> ChildSpec:
    return ChildSpec("credentials", [sys.executable, "-c", CHILD, *extra], dict(ENV), links or LinkSecrets())


def test_crash_loop_is_restarted_with_exponential_backoff(caplog):
    caplog.set_level(logging.INFO, logger="services.launcher.process_supervisor")
    crash = ChildSpec("scheduler", [sys.executable, "-c", "import sys; sys.exit(3)"], dict(ENV), LinkSecrets())
    sup = Supervisor([crash], backoff_first=0.05, backoff_max=0.2)
    child = sup.children[0]
    child.start()
    deadline = time.monotonic() + 30
    while len(child.delays) < 5 and time.monotonic() < deadline:
        sup.tick(0.02)
    sup.stop_all()
    assert child.delays[:5] == [0.05, 0.1, 0.2, 0.2, 0.2]
    assert child.restarts >= 4
    assert "scheduler (pid" in caplog.text and "exited with code 3; restarting in 0.1 s" in caplog.text


def test_link_secrets_arrive_on_the_fd_never_in_argv_or_environment():
    links = LinkSecrets(serve={"scheduler": new_secret()}, call={"sandbox": new_secret()})
    sup = Supervisor([spec(links=links)], ready_timeout=30)
    try:
        sup.start_all()
        child = sup.children[0]
        assert child.ready["links"] == hashlib.sha256(links.to_json()).hexdigest()
        pid = child.pid
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        for secret in [*links.serve.values(), *links.call.values()]:
            assert secret.hex().encode() not in cmdline + environ
        assert "ChildSpec(credentials" in repr(child.spec) and links.serve["scheduler"].hex() not in repr(child.spec)
    finally:
        sup.stop_all()


def test_child_ignoring_sigterm_is_killed_after_the_grace(caplog):
    sup = Supervisor([spec("ignore-term")], ready_timeout=30)
    sup.start_all()
    pid = sup.children[0].pid
    assert alive(pid)
    sup.stop_all(grace=0.5)
    assert not alive(pid)
    assert "did not stop within" in caplog.text


def test_readiness_line_is_required(tmp_path):
    """A child that exits before reporting ready fails the start with a clear message."""
    from services.common.errors import FailedPrecondition

    bad = ChildSpec("gateway", [sys.executable, "-c", "raise SystemExit(7)"], dict(ENV), LinkSecrets())
    sup = Supervisor([bad], ready_timeout=30)
    with pytest.raises(FailedPrecondition, match="gateway process exited with code 7 before it was ready"):
        sup.start_all()
    sup.stop_all()
