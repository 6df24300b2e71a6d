"""Removing a ticket's Docker objects (containers with their volumes, then
networks), found only by this broker's labels: all of one ticket's, or those
of every ticket that is no longer live (R12 reconcile)."""

from __future__ import annotations

import contextlib

import docker
import docker.errors

from services.sandbox.containers.hardening import LABEL_TICKET


def remove_objects(client: docker.DockerClient, filters: dict[str, list[str]]) -> int:
    """Remove every container and network matching `filters`; the count removed."""
    removed = 0
    for c in client.api.containers(all=True, filters=filters):
        with contextlib.suppress(docker.errors.NotFound):
            client.api.remove_container(c["Id"], force=True, v=True)
            removed += 1
    for net in client.api.networks(filters=filters):
        with contextlib.suppress(docker.errors.NotFound):
            client.api.remove_network(net["Id"])
            removed += 1
    return removed


def remove_dead(client: docker.DockerClient, filters: dict[str, list[str]], live: set[str]
                ) -> tuple[set[str], int, int]:
    """Remove the objects matching `filters` whose ticket is not in `live`:
    (the tickets they belonged to, containers removed, networks removed)."""
    tickets: set[str] = set()
    nc = nn = 0
    for c in client.api.containers(all=True, filters=filters):
        t = c["Labels"].get(LABEL_TICKET, "")
        if t not in live:
            with contextlib.suppress(docker.errors.NotFound):
                client.api.remove_container(c["Id"], force=True, v=True)
                nc += 1
            tickets.add(t)
    for net in client.api.networks(filters=filters):
        t = net["Labels"].get(LABEL_TICKET, "")
        if t not in live:
            with contextlib.suppress(docker.errors.NotFound):
                client.api.remove_network(net["Id"])
                nn += 1
            tickets.add(t)
    return tickets, nc, nn
