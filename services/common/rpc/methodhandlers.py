"""Rebuilding a gRPC method handler around a wrapper of its behaviour, for
the interceptors that change how a call runs (TicketLogging, TextDecoding).

grpc has no type information, so a handler and its context are `Any`; the
behaviours are typed by what they return: an awaitable (unary response) or
an async iterator (streamed response).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

# (request or request iterator, context) -> response awaitable or response stream
Behaviour = Callable[[Any, Any], Any]
UnaryBehaviour = Callable[[Any, Any], Awaitable[Any]]
StreamBehaviour = Callable[[Any, Any], AsyncIterator[Any]]
# An interceptor's continuation: the handler of the method called, or None.
Continuation = Callable[[Any], Awaitable[Any]]


def rebuild(handler: Any, wrap: Callable[[Any, bool, bool], Behaviour],
            deserializer: Callable[[bytes], Any] | None = None) -> Any:
    """The same kind of method handler around `wrap(fn, request_streaming, response_streaming)`."""
    des = deserializer or handler.request_deserializer
    ser = handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False, False), des, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, False, True), des, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, True, False), des, ser)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True, True), des, ser)


def around(fn: Any, request_streaming: bool, response_streaming: bool,
           before: Callable[[Any], Any], after: Callable[[Any], None],
           each: Callable[[Any], None] | None = None) -> Behaviour:
    """A handler that runs `before(request)` (its result goes to `after`), then
    `fn`; with a request stream, `each` sees every message as it is read."""
    async def requests(it: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for message in it:
            if each is not None:
                each(message)
            yield message

    if response_streaming:
        async def stream(request_or_iter: Any, context: Any) -> AsyncIterator[Any]:
            token = before(None if request_streaming else request_or_iter)
            try:
                source = requests(request_or_iter) if request_streaming else request_or_iter
                async for item in fn(source, context):
                    yield item
            finally:
                after(token)
        return stream

    async def unary(request_or_iter: Any, context: Any) -> Any:
        token = before(None if request_streaming else request_or_iter)
        try:
            return await fn(requests(request_or_iter) if request_streaming else request_or_iter, context)
        finally:
            after(token)
    return unary
