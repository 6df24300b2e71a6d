"""One root error type; subclasses are named after the gRPC status they map to.

The core of every process raises these; `grpcutil` turns them into status
codes in one place and the gateway turns them into JSON-RPC error codes in
one place. Messages are for people: they say what to change. They pass
through the process's redactor before they leave the process.
"""

from __future__ import annotations


class AfeError(Exception):
    """Root of every error afe raises on purpose."""

    code = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidArgument(AfeError):
    code = "INVALID_ARGUMENT"


class NotFound(AfeError):
    code = "NOT_FOUND"


class AlreadyExists(AfeError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(AfeError):
    code = "FAILED_PRECONDITION"


class PermissionDenied(AfeError):
    code = "PERMISSION_DENIED"


class Unauthenticated(AfeError):
    code = "UNAUTHENTICATED"


class Unavailable(AfeError):
    code = "UNAVAILABLE"


class PeerUnavailable(Unavailable):
    """The process at the other end of a local link did not answer at all: it
    is not running, or it went away during the call (its connection closed).
    Unlike an `Unavailable` the peer itself returned, this one is worth
    retrying while the launcher restarts the peer. Built only by the gRPC
    client helpers (`grpcutil.rpc_errors`), never sent as a status."""


class DeadlineExceeded(AfeError):
    code = "DEADLINE_EXCEEDED"


class ResourceExhausted(AfeError):
    code = "RESOURCE_EXHAUSTED"


class Cancelled(AfeError):
    code = "CANCELLED"


class Aborted(AfeError):
    """A concurrent change won (the base branch moved since a verification): do the step again."""
    code = "ABORTED"


class Internal(AfeError):
    code = "INTERNAL"


class ConfigError(InvalidArgument):
    """A manifest or setting is wrong; the message names file, document and field."""


BY_CODE: dict[str, type[AfeError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        PermissionDenied,
        Unauthenticated,
        Unavailable,
        DeadlineExceeded,
        ResourceExhausted,
        Cancelled,
        Aborted,
        Internal,
    )
}


def from_code(code: str, message: str) -> AfeError:
    """Rebuild an AfeError from a status code name (used by gRPC clients)."""
    return BY_CODE.get(code, Internal)(message)
