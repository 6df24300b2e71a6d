"""Which host names a ticket's egress proxy refused (R11) and let through,
and every request it logged (R44), read back from the proxy container's
access log (squid logs to stdout) through the Docker API; the parsing, which
trusts nothing in the sandbox-made log, is `egress.denied_hosts` and
`egress.logged_requests`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import docker.errors

from services.common.errors import NotFound
from services.sandbox.egress.allowlist import (
    DENIED_LOG_BYTES,
    DENIED_LOG_LINES,
    RequestCount,
    allowed_hosts,
    denied_hosts,
    logged_requests,
)

if TYPE_CHECKING:
    from services.sandbox.sandboxes import SandboxManager


Hosts = tuple[list[tuple[str, int]], bool]


@dataclass(frozen=True)
class EgressLog:
    denied: Hosts                                   # ([(host, count)], truncated)
    allowed: Hosts
    requests: tuple[list[RequestCount], bool]       # every request, grouped (R44)


async def denied_egress(sandboxes: SandboxManager, ticket_id: str) -> EgressLog:
    """Refused hosts, let-through hosts and every request, from the newest
    DENIED_LOG_LINES lines of the proxy's log (at most DENIED_LOG_BYTES);
    nothing without egress."""
    info = await sandboxes.get(ticket_id)
    proxy_id = info.proxy_container_id
    if not proxy_id:
        return EgressLog(([], False), ([], False), ([], False))

    def read() -> str:
        chunks, size = [], 0
        for chunk in sandboxes.client.api.logs(proxy_id, stdout=True, stderr=False, stream=True, follow=False,
                                               tail=DENIED_LOG_LINES):
            chunks.append(chunk)
            size += len(chunk)
            if size >= DENIED_LOG_BYTES:
                break
        return b"".join(chunks).decode("utf-8", "replace")
    try:
        text = await asyncio.to_thread(read)
    except docker.errors.NotFound as exc:
        sandboxes.forget(ticket_id)
        raise NotFound(f"no egress proxy for ticket {ticket_id}: create the sandbox again") from exc
    return EgressLog(denied_hosts(text), allowed_hosts(text), logged_requests(text))
