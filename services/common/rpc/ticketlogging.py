"""The interceptor that names, in every log record written while a call is
handled, the ticket the request is about (`ticket_of`)."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import grpc

from services.common.observability.logs import ticket_var
from services.common.rpc.methodhandlers import Continuation, around, rebuild


def ticket_of(message: Any) -> str | None:
    """The ticket a request is about: its `ticket_id` field; the `id` of a
    scheduler `*TicketRequest` (GetTicketRequest, WatchTicketRequest, ...);
    else that of the one sub-message set (a stream's `start`)."""
    desc = getattr(message, "DESCRIPTOR", None)
    if desc is None:
        return None
    fields = desc.fields_by_name
    if "ticket_id" in fields and fields["ticket_id"].type == fields["ticket_id"].TYPE_STRING:
        return message.ticket_id or None
    if desc.name.endswith("TicketRequest") and "id" in fields:
        return message.id or None
    for f in desc.fields:
        if f.message_type is None:
            continue
        try:
            present = message.HasField(f.name)
        except ValueError:  # repeated or map: not a sub-message naming the call's ticket
            continue
        if present and (found := ticket_of(getattr(message, f.name))):
            return found
    return None


class TicketLogging(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no type information
    """Log records written while a call is handled name the ticket the
    request is about (services/common/observability/logs.py::ticket_var; logs may name a
    ticket, metric labels may not). Sits outside the guard, so the guard's
    own line about a failed call names the ticket too."""

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None

        def before(request: Any) -> contextvars.Token[str | None]:
            return ticket_var.set(ticket_of(request))

        def after(token: contextvars.Token[str | None]) -> None:
            with contextlib.suppress(ValueError):  # finalized in another context: nothing to reset
                ticket_var.reset(token)

        def each(message: Any) -> None:
            if ticket_var.get() is None:
                ticket_var.set(ticket_of(message))

        return rebuild(handler, lambda fn, rs, ss: around(fn, rs, ss, before, after, each))
