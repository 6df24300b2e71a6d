"""An existing sandbox brought back by an idempotent create, after the
Docker engine or the host restarted (or thawed, when a step's freeze
outlived the process that made it): the egress proxy first (the sandbox's
only way out must be up before the sandbox runs again; with egress rules its
new CA goes into the sandbox's bundle, R44), then the sandbox
container, then its forwarders (relays/forward.py): the egress socket's
(egress/over_socket.py) and the model relay's.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import docker

from services.common.layout import Layout
from services.sandbox.containers.info import SandboxInfo
from services.sandbox.egress import ca as egress_ca
from services.sandbox.egress import over_socket as egress_socket
from services.sandbox.egress import proxy as egress_proxy
from services.sandbox.relays import forward as relayforward


async def bring_back(client: docker.DockerClient, existing: SandboxInfo, egress_network: str,
                     layout: Layout) -> SandboxInfo:
    """Start what of `existing` is stopped; returns its info as it now is."""
    proxy_id = existing.proxy_container_id
    if proxy_id:
        # after an engine restart the proxy is stopped too: bring it back first
        attrs = await asyncio.to_thread(client.api.inspect_container, proxy_id)
        if not attrs["State"].get("Running"):
            if existing.egress_socket:
                await asyncio.to_thread(egress_socket.make_egress_dir, layout, existing.ticket_id)
            await asyncio.to_thread(client.api.start, proxy_id)
            if existing.egress_socket:
                def running() -> bool:
                    return bool(client.api.inspect_container(proxy_id)["State"].get("Running"))
                await egress_socket.wait_socket(layout, existing.ticket_id, running)
            else:
                await egress_proxy.wait_proxy(client, proxy_id, egress_network)
            if existing.egress_rules:       # a new tmpfs: the proxy made a new CA (R44)
                await asyncio.to_thread(egress_ca.install, client, proxy_id, layout, existing.ticket_id)
    if existing.state == "exited":
        await asyncio.to_thread(client.api.start, existing.container_id)
        existing = replace(existing, state="running")
    elif existing.state == "paused":
        # Frozen for a builtin step by a scheduler or broker that stopped before thawing it (`afe
        # up` ended mid-step): a create comes before any use, and an exec into a frozen sandbox
        # never returns (runc waits on the frozen cgroup, holding the engine's lock on the
        # container, so even `docker inspect` of it hangs). Thawed first.
        await asyncio.to_thread(client.api.unpause, existing.container_id)
        existing = replace(existing, state="running")
    if existing.egress_socket and existing.state == "running":
        await asyncio.to_thread(relayforward.start, client, existing.container_id,
                                egress_socket.SANDBOX_FORWARDER, "the egress proxy's forwarder")
    if existing.relay and existing.state == "running":
        await asyncio.to_thread(relayforward.start, client, existing.container_id)
    return existing
