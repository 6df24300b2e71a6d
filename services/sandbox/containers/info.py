"""What the sandbox broker says about a ticket's sandbox (`SandboxInfo`), read
back from Docker's container summaries and labels, and what a reconcile removed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import docker

from services.sandbox.containers import hardening
from services.sandbox.containers.hardening import LABEL_ENV, LABEL_RELAY, LABEL_ROLE, LABEL_TICKET


@dataclass(frozen=True)
class SandboxInfo:
    ticket_id: str
    container_id: str
    state: str
    image: str
    network: str = ""
    proxy_container_id: str = ""
    created_at_ms: int = 0
    env_names: tuple[str, ...] = ()
    disk_bytes: int = 0          # the workspace's disk cap (label afe.disk; 0 = unknown)
    relay: bool = False          # the ticket's model relay folder is mounted (label afe.relay, R32)
    runtime: str = "runc"        # runc | gvisor (label afe.runtime)
    egress_socket: bool = False  # egress through the proxy's socket, no interface (label afe.egress)
    egress_rules: bool = False   # hosts with rules, judged decrypted (label afe.egress.rules, R44)


@dataclass(frozen=True)
class ReconcileResult:
    removed_tickets: tuple[str, ...]
    removed_containers: int
    removed_networks: int


def info_from_summary(c: dict[str, Any], proxy: dict[str, Any] | None) -> SandboxInfo:
    st = c.get("State", "")
    state = {"running": "running", "paused": "paused"}.get(st, "exited")
    nets = list((c.get("NetworkSettings") or {}).get("Networks", {}) or {})
    network = next((n for n in nets if n not in ("none", "bridge", "host")), "")
    env = tuple(n for n in c["Labels"].get(LABEL_ENV, "").split(",") if n)
    disk = c["Labels"].get(hardening.LABEL_DISK, "")
    relay = c["Labels"].get(LABEL_RELAY) == "1"
    runtime = c["Labels"].get(hardening.LABEL_RUNTIME) or "runc"
    return SandboxInfo(ticket_id=c["Labels"][LABEL_TICKET], container_id=c["Id"], state=state,
                       image=c.get("Image", ""), network=network,
                       proxy_container_id=proxy["Id"] if proxy else "",
                       created_at_ms=int(c.get("Created", 0)) * 1000, env_names=env,
                       disk_bytes=int(disk) if disk.isdigit() else 0, relay=relay, runtime=runtime,
                       egress_socket=c["Labels"].get(hardening.LABEL_EGRESS) == "socket",
                       egress_rules=c["Labels"].get(hardening.LABEL_EGRESS_RULES) == "1")


def find_sandbox(client: docker.DockerClient, filters: dict[str, list[str]]) -> SandboxInfo | None:
    """The sandbox among the containers matching one ticket's `filters` (None when there is none)."""
    cs = client.api.containers(all=True, filters=filters)
    sandbox = next((c for c in cs if c["Labels"].get(LABEL_ROLE) == "sandbox"), None)
    if sandbox is None:
        return None
    proxy = next((c for c in cs if c["Labels"].get(LABEL_ROLE) == "proxy"), None)
    return info_from_summary(sandbox, proxy)


def list_sandboxes(client: docker.DockerClient, filters: dict[str, list[str]]) -> list[SandboxInfo]:
    """Every sandbox matching `filters`, by ticket id."""
    cs = client.api.containers(all=True, filters=filters)
    proxies = {c["Labels"][LABEL_TICKET]: c for c in cs if c["Labels"].get(LABEL_ROLE) == "proxy"}
    return sorted((info_from_summary(c, proxies.get(c["Labels"][LABEL_TICKET]))
                   for c in cs if c["Labels"].get(LABEL_ROLE) == "sandbox"), key=lambda i: i.ticket_id)
