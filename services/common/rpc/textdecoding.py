"""The interceptor that decodes requests itself, so a request that is not
valid (a string field with invalid UTF-8, bytes that are no message) gets
INVALID_ARGUMENT with a message that says so."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from services.common import errors
from services.common.rpc.methodhandlers import Continuation, around, rebuild


class _BadRequest:
    """What the lenient decoder hands on instead of a message it could not decode."""

    def __init__(self, message: str) -> None:
        self.message = message


NOT_UTF8 = "a text field is not valid UTF-8; send UTF-8 text"


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            if "UTF-8" in str(exc):
                return _BadRequest(NOT_UTF8)
            return _BadRequest("the request could not be decoded as this method's request message")
    return decode


class TextDecoding(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no type information
    """Requests are decoded here rather than inside grpc, so a string field
    with invalid UTF-8 (or bytes that are no message at all) gets
    INVALID_ARGUMENT with a message that says so, not an opaque decode
    failure. Sits inside the guard, which turns the error into the status."""

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None

        def check(request: Any) -> None:
            if isinstance(request, _BadRequest):
                raise errors.InvalidArgument(request.message)

        return rebuild(handler, lambda fn, rs, ss: around(fn, rs, ss, check, lambda _: None, check),
                       _lenient(handler.request_deserializer))
