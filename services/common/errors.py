"""One root error type; subclasses are named after the gRPC status they map to.

The core of every process raises these; `grpcutil` turns them into status
codes in one place and the gateway turns them into JSON-RPC error codes in
one place. Messages are for people: they say what to change. They pass
through the process's redactor before they leave the process.

What a program must recognise in another process's error travels as a
`Reason` (the `reason` of a google.rpc.ErrorInfo in the status details,
statuses.py), never as words of the message: a message is for people and
may change, and text a caller put in a request (a ticket's title, a branch
name) can end up inside one.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why a call failed, where the caller acts on it (the contract between processes)."""

    # The ticket has a newer owner (R37, R45): the credential broker refused a side effect whose
    # fence is stale or whose lease ended; the scheduler stops the run without a write (LeaseLost).
    LEASE_LOST = "LEASE_LOST"
    # The database that holds the fences does not answer the credential broker: nothing was done,
    # the scheduler tries the step again.
    FENCE_STORE_AWAY = "FENCE_STORE_AWAY"


class AfeError(Exception):
    """Root of every error afe raises on purpose. `reason`: what a caller in
    another process may act on (None: only the code and the message)."""

    code = "INTERNAL"
    reason: Reason | None = None

    def __init__(self, message: str, *, reason: Reason | None = None) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason

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


def from_code(code: str, message: str, reason: Reason | None = None) -> AfeError:
    """Rebuild an AfeError from a status code name (used by gRPC clients)."""
    return BY_CODE.get(code, Internal)(message, reason=reason)
