"""The interceptor that counts handled calls by method and status code and
times them (`afe_grpc_server_handled_total{method,code}`), and counts the
streams `send_within` dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.common.observability import metrics
from services.common.rpc.methodhandlers import Continuation, StreamBehaviour, UnaryBehaviour
from services.common.rpc.streamdrop import on_drop


class CallMetrics(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no type information
    """Counts handled calls by method and status code, and times them (R25:
    the method comes from the compiled-in contracts, never from a caller)."""

    def __init__(self, families: metrics.GrpcServerMetrics) -> None:
        self.families = families

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        method = details.method
        if handler is None or method not in metrics.GRPC_METHODS:
            return handler
        handled, seconds, dropped = self.families.handled, self.families.seconds, self.families.dropped

        def record(context: grpc.aio.ServicerContext, t0: float, exc: BaseException | None) -> None:
            code = None
            with contextlib.suppress(Exception):
                code = context.code()
            if isinstance(exc, asyncio.CancelledError):
                name = "CANCELLED"
            elif code is not None and hasattr(code, "name"):
                name = code.name
            elif exc is not None:
                name = "UNKNOWN"
            else:
                name = "OK"
            handled.labels(method=method, code=name).inc()
            seconds.labels(method=method).observe(time.perf_counter() - t0)

        def wrap_unary(fn: UnaryBehaviour) -> UnaryBehaviour:
            async def call(request_or_iter: Any, context: grpc.aio.ServicerContext) -> Any:
                t0, exc = time.perf_counter(), None
                try:
                    return await fn(request_or_iter, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    record(context, t0, exc)
            return call

        def count_drop() -> None:
            dropped.labels(method=method).inc()

        def wrap_stream(fn: StreamBehaviour) -> StreamBehaviour:
            async def call(request_or_iter: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                t0, exc = time.perf_counter(), None
                token = on_drop.set(count_drop)
                try:
                    async for item in fn(request_or_iter, context):
                        yield item
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    with contextlib.suppress(ValueError):  # finalized in another context: nothing to reset
                        on_drop.reset(token)
                    record(context, t0, exc)
            return call

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary),
                                                       handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream),
                                                        handler.request_deserializer,
                                                        handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary),
                                                        handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(wrap_stream(handler.stream_stream),
                                                     handler.request_deserializer,
                                                     handler.response_serializer)
