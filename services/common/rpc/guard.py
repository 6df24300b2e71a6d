"""The check every afe gRPC server makes on every call: the caller's link
secret (and the caller table in callers.py), then every exception the
handler raises turned into a redacted status (`AfeError` -> its code).
"""

from __future__ import annotations

import contextlib
import contextvars
import hmac
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import grpc

from services.common import errors
from services.common.rpc import callers
from services.common.rpc.links import METADATA_KEY
from services.common.rpc.methodhandlers import Continuation, StreamBehaviour, UnaryBehaviour
from services.common.rpc.statuses import ORIGIN, status_for, trailers_for
from services.common.rpc.streamdrop import StreamDropped
from services.common.secrecy.redact import Redactor

log = logging.getLogger(__name__)

caller_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("afe_caller", default=None)


class CallerSecrets:
    """The secrets a server accepts, by caller name. A caller's secret may be
    replaced while the server runs (the scheduler follows `<run>/automation.key`
    so `afe token rotate --automation` takes effect without a restart); the set
    of callers never changes."""

    def __init__(self, secrets: Mapping[str, bytes]) -> None:
        self._secrets = dict(secrets)

    def __repr__(self) -> str:  # never show the secrets
        return f"CallerSecrets({sorted(self._secrets)})"

    def items(self) -> list[tuple[str, bytes]]:
        return list(self._secrets.items())

    def get(self, caller: str) -> bytes | None:
        return self._secrets.get(caller)

    def replace(self, caller: str, secret: bytes) -> None:
        if caller not in self._secrets:
            raise KeyError(f"{caller!r} is not a caller of this server")
        self._secrets[caller] = secret


NO_KEY = ("no link key presented: send the caller's key as hex in the `" + METADATA_KEY
          + "` metadata (local automation: the contents of <run>/automation.key)")
WRONG_KEY = "this caller is not allowed on this socket (the key is not one this server accepts)"


class Guard(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no type information
    """Checks the link secret, then maps exceptions to redacted statuses."""

    def __init__(self, accepted: Mapping[str, bytes] | CallerSecrets, redactor: Redactor) -> None:
        self.accepted = accepted if isinstance(accepted, CallerSecrets) else CallerSecrets(accepted)
        self.redactor = redactor

    @staticmethod
    def _presented(metadata: Iterable[Any] | None) -> bool:
        return any(key == METADATA_KEY and value for key, value in metadata or ())

    def _who(self, metadata: Iterable[Any] | None) -> str | None:
        presented: bytes | None = None
        for key, value in metadata or ():
            if key == METADATA_KEY:
                presented = value.encode() if isinstance(value, str) else value
        if not presented:
            return None
        try:
            raw = bytes.fromhex(presented.decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            return None
        found = None
        for name, secret in self.accepted.items():
            if hmac.compare_digest(raw, secret):  # compare with every secret: no early exit
                found = name
        return found

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        who = self._who(details.invocation_metadata)
        method = details.method
        redact = self.redactor.redact

        # PERMISSION_DENIED either way (the documented contract); the text says which mistake it was.
        why = WRONG_KEY if self._presented(details.invocation_metadata) else NO_KEY
        service = callers.service_of(method)
        if who is not None and not callers.may_call(who, service):
            why, who = callers.refusal(who, service), None   # a good key, but not for this service

        async def deny(request_or_iter: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why, ORIGIN)

        async def deny_stream(request_or_iter: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why, ORIGIN)
            yield  # pragma: no cover

        async def fail(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
            if isinstance(exc, errors.AfeError):
                code, msg = status_for(exc)
                log.info("%s -> %s: %s", method, code.name, redact(msg))
            else:
                code, msg = status_for(exc)
                # The type, not the repr: a UnicodeError's repr holds the whole text it failed on (an
                # issue's body, a payload). The traceback below ends with str(exc), which names only
                # the character and its position.
                log.error("%s failed: %s", method, type(exc).__name__, exc_info=exc)
            msg = redact(msg)
            await context.abort(code, msg, trailers_for(exc, code, msg))

        def wrap_unary(fn: UnaryBehaviour) -> UnaryBehaviour:
            async def call(request_or_iter: Any, context: grpc.aio.ServicerContext) -> Any:
                token = caller_var.set(who)
                try:
                    return await fn(request_or_iter, context)
                except (grpc.aio.AbortError, grpc.RpcError):
                    raise
                except Exception as exc:  # noqa: BLE001 - the server boundary: every error becomes a status
                    await fail(context, exc)
                finally:
                    caller_var.reset(token)
            return call

        def wrap_stream(fn: StreamBehaviour) -> StreamBehaviour:
            async def call(request_or_iter: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                token = caller_var.set(who)
                try:
                    async for item in fn(request_or_iter, context):
                        yield item
                except StreamDropped:
                    return  # send_within has already set the status; ending here lets grpc finish the call
                except (grpc.aio.AbortError, grpc.RpcError):
                    raise
                except Exception as exc:  # noqa: BLE001 - the server boundary: every error becomes a status
                    await fail(context, exc)
                finally:
                    with contextlib.suppress(ValueError):  # finalized in another context: nothing to reset
                        caller_var.reset(token)
            return call

        if handler.unary_unary:
            unary = deny if who is None else wrap_unary(handler.unary_unary)
            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream:
            stream = deny_stream if who is None else wrap_stream(handler.unary_stream)
            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        if handler.stream_unary:
            unary = deny if who is None else wrap_unary(handler.stream_unary)
            return grpc.stream_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                        handler.response_serializer)
        stream = deny_stream if who is None else wrap_stream(handler.stream_stream)
        return grpc.stream_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                     handler.response_serializer)
