"""Checks the sandbox broker makes before it creates a ticket's objects: the
engine's version for egress bridges (R31), the OCI runtime a sandbox asks
for, the model relay's folder (R32), the bridge's host address (R31), and
the workspace's ownership fix-up (R34)."""

from __future__ import annotations

import logging
import os
import re
import stat

import docker

from services.common import safefs
from services.common.errors import FailedPrecondition
from services.common.layout import Layout
from services.sandbox.egress.proxy import bridge_ipv4

log = logging.getLogger(__name__)

GVISOR_RUNTIME = "runsc"      # the engine's name for gVisor, unless the broker is told another


def check_relay_dir(layout: Layout, ticket_id: str) -> None:
    """The folder mounted is the one the layout names for this ticket,
    never a path from a caller, and it must be a real directory (not a
    link that would mount some other host folder)."""
    d = layout.relay_dir(ticket_id)
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        raise FailedPrecondition(
            f"the model relay of {ticket_id} is not open: the scheduler opens it at the credential broker "
            "(OpenRelay) before it creates the sandbox") from None
    if not stat.S_ISDIR(st.st_mode):
        raise FailedPrecondition(f"{d} is not a directory; remove it and run the ticket again")


def check_engine_for_egress(client: docker.DockerClient) -> None:
    """R31 needs a bridge without a host address (`inhibit_ipv4`), which
    Docker 20.10 introduced; an older engine would ignore the option and
    give the bridge an address every sandbox could reach."""
    version = str(client.version().get("Version", ""))
    m = re.match(r"^(\d+)\.(\d+)", version)
    if not m or (int(m[1]), int(m[2])) < (20, 10):
        raise FailedPrecondition(
            f"egress sandboxes need Docker 20.10 or newer (this engine is {version or 'unknown'}): "
            "upgrade Docker, or run the ticket without sandbox.egress")


def engine_runtimes(client: docker.DockerClient) -> list[str]:
    """The OCI runtimes the engine has registered (docker info)."""
    return sorted((client.info().get("Runtimes") or {}).keys())


def runtime_missing_message(name: str, have: list[str]) -> str:
    return (f"sandbox.runtime gvisor needs the Docker runtime {name!r}, which this engine does not have (it has: "
            f"{', '.join(have) or 'none'}). Install gVisor (Debian/Ubuntu: apt-get install runsc), register it "
            f"in /etc/docker/daemon.json as \"runtimes\": {{\"{name}\": {{\"path\": \"/usr/bin/runsc\", "
            "\"runtimeArgs\": [\"--network=none\", \"--host-uds=open\"]}}, reload dockerd (kill -HUP its "
            "pid, or systemctl reload docker), and check with `afe doctor`; or set sandbox.runtime: runc")


def check_runtime(client: docker.DockerClient, name: str) -> None:
    """The engine has the runtime `name`, else an error that says how to add it."""
    have = engine_runtimes(client)
    if name not in have:
        raise FailedPrecondition(runtime_missing_message(name, have))


def check_bridge_has_no_address(name: str) -> None:
    """R31, checked at every egress sandbox's creation: the ticket's bridge
    must not give the host an address on it (where the broker can see it)."""
    addr = bridge_ipv4(name)
    if addr:
        raise FailedPrecondition(
            f"Docker gave the ticket network's bridge {name} the host address {addr}, so the sandbox could "
            "reach the host: this engine ignores com.docker.network.bridge.inhibit_ipv4; upgrade Docker "
            "(20.10 or newer)")
    if addr is None:
        log.debug("bridge %s is not visible from the broker's network namespace; not checked", name)


CHOWN_LIMITS = safefs.Limits("the sandbox's workspace ownership check")  # depth 256, 1,000,000 entries


def chown_tree(root: str, uid: int, gid: int) -> int:
    """Give every entry of a tree to uid:gid without following any symlink:
    `safefs.chown_tree`, the one fix-up both brokers use (iterative, bounded by
    `CHOWN_LIMITS`, fchownat(AT_SYMLINK_NOFOLLOW) from the parent's fd; R34).
    Returns the count changed."""
    return safefs.chown_tree(root, uid, gid, CHOWN_LIMITS)
