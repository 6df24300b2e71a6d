"""What a status set by an afe server looks like: the code an `AfeError`
maps to (in one place), and the trailing metadata that marks it as set on
purpose.
"""

from __future__ import annotations

import grpc

from services.common import errors

_CODES = {name: getattr(grpc.StatusCode, name) for name in errors.BY_CODE}

# Every status an afe server sets on purpose carries this trailing metadata,
# so a client can tell "the peer answered with an error" from "the peer went
# away" (a status made up by the gRPC library from a closed connection).
ORIGIN_KEY = "afe-status"
ORIGIN = ((ORIGIN_KEY, "1"),)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, errors.AfeError):
        return _CODES.get(exc.code, grpc.StatusCode.INTERNAL), exc.message
    return grpc.StatusCode.INTERNAL, "internal error (details are in the server log)"
