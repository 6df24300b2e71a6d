"""Which host names a ticket's egress proxy refused (R11), read back from
the proxy container's access log (squid logs to stdout) through the Docker
API; the parsing, which trusts nothing in the sandbox-made log, is
`egress.denied_hosts`."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import docker.errors

from services.common.errors import NotFound

from .egress import DENIED_LOG_BYTES, DENIED_LOG_LINES, allowed_hosts, denied_hosts

if TYPE_CHECKING:
    from .sandboxes import SandboxManager


Hosts = tuple[list[tuple[str, int]], bool]


async def denied_egress(sandboxes: SandboxManager, ticket_id: str) -> tuple[Hosts, Hosts]:
    """(refused, let through), each ([(host, count)], truncated), from the newest
    DENIED_LOG_LINES lines of the proxy's log (at most DENIED_LOG_BYTES);
    nothing without egress."""
    info = await sandboxes.get(ticket_id)
    proxy_id = info.proxy_container_id
    if not proxy_id:
        return ([], False), ([], False)

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
    return denied_hosts(text), allowed_hosts(text)
