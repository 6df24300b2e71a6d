"""What a status set by an afe server looks like: the code an `AfeError`
maps to (in one place), the trailing metadata that marks it as set on
purpose, and the error's `Reason` as a google.rpc.ErrorInfo in the status
details (gRPC's rich error model: `grpc-status-details-bin`), read back by
the client (channels.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from services.common import errors

_CODES = {name: getattr(grpc.StatusCode, name) for name in errors.BY_CODE}

# Every status an afe server sets on purpose carries this trailing metadata,
# so a client can tell "the peer answered with an error" from "the peer went
# away" (a status made up by the gRPC library from a closed connection).
ORIGIN_KEY = "afe-status"
ORIGIN = ((ORIGIN_KEY, "1"),)


DETAILS_KEY = "grpc-status-details-bin"
DOMAIN = "afe"      # ErrorInfo.domain of afe's reasons


def trailers_for(exc: BaseException, code: grpc.StatusCode, message: str) -> tuple[tuple[str, str | bytes], ...]:
    """The trailing metadata of a status set for `exc`: ORIGIN, and the error's reason
    (when it has one) as a google.rpc.Status whose details hold an ErrorInfo."""
    reason = exc.reason if isinstance(exc, errors.AfeError) else None
    if reason is None:
        return ORIGIN
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason.value, domain=DOMAIN))
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    return (*ORIGIN, (DETAILS_KEY, status.SerializeToString()))


def reason_in(trailers: Iterable[tuple[str, str | bytes]]) -> errors.Reason | None:
    """The afe reason in a status's trailing metadata (None: none, or one this
    version does not know)."""
    for key, value in trailers:
        if key != DETAILS_KEY or not isinstance(value, bytes):
            continue
        status = status_pb2.Status()
        try:
            status.ParseFromString(value)
        except Exception:  # noqa: BLE001 - a malformed detail carries no reason
            return None
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info) and info.domain == DOMAIN:
                try:
                    return errors.Reason(info.reason)
                except ValueError:
                    return None
    return None


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, errors.AfeError):
        return _CODES.get(exc.code, grpc.StatusCode.INTERNAL), exc.message
    return grpc.StatusCode.INTERNAL, "internal error (details are in the server log)"
