"""The params of every JSON-RPC method of the gateway's /rpc, one pydantic
model each (strict types, unknown fields refused). `tickets.create` takes
its title, body and inputs with the types of `tickets.TicketText`, the limits the
scheduler applies too; the CLI checks its request with the same model
before it sends it.

`validate_params(method, params)` returns the checked params with defaults
filled in, as the method's model (the gateway hands it to the method's
handler), or raises `InvalidArgument` with a message that names the field
(the gateway maps it to JSON-RPC -32602 invalid_params); `parse_params` is
the same as a plain dict."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from ..errors import InvalidArgument
from ..layout import TICKET_ID_RE
from .tickets import Body, Inputs, Title, problem

__all__ = [
    "METHODS", "TICKET_STATE_NAMES", "ApproveParams", "CreateParams", "FollowUpParams", "ListParams",
    "NoParams", "PullParams", "RejectParams", "RetryParams", "TicketParams", "UnwatchParams", "WatchParams",
    "parse_params", "validate_params",
]

# The ticket states /rpc speaks (gateway/convert.py maps them to the scheduler's enum).
TICKET_STATE_NAMES = ("queued", "running", "waiting_approval", "succeeded", "failed", "cancelled")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
_SHA = re.compile(r"[0-9a-f]{7,64}")
_PR_NUMBER = re.compile(r"[0-9]{1,20}")


def _matching(pattern: re.Pattern[str], hint: str) -> AfterValidator:
    """A text that is empty or matches `pattern`; else `hint` (what to write)."""
    def check(value: str) -> str:
        if value and not pattern.fullmatch(value):
            raise PydanticCustomError("pattern", hint)
        return value
    return AfterValidator(check)


TicketId = Annotated[str, _matching(TICKET_ID_RE, "must be a ticket id (a-z, 0-9 and '-', "
                                                                       "at most 63)")]


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class NoParams(_Params):
    pass


class CreateParams(_Params):
    workspace: Annotated[str, Field(max_length=100), _matching(_NAME, "must be a workspace name")] = ""
    workflow: Annotated[str, Field(min_length=1, max_length=100), _matching(_NAME, "must be a workflow name")]
    title: Title                               # the limits of tickets.TicketText
    body: Body = ""
    inputs: Inputs = Field(default_factory=dict)


class ListParams(_Params):
    states: list[Literal[TICKET_STATE_NAMES]] = Field(default_factory=list, max_length=6)  # type: ignore[valid-type]
    workspace: str = Field("", max_length=100)
    page_size: int = Field(50, ge=1, le=500)
    page_token: str = Field("", max_length=512)


class TicketParams(_Params):
    id: TicketId


class ApproveParams(TicketParams):
    sha: Annotated[str, _matching(_SHA, "must be a hex commit SHA")] = ""
    # R41: the person saw that the head changes how its tests run and approves it anyway
    accept_harness_change: bool = False


class RejectParams(TicketParams):
    reason: str = Field("", max_length=2000)


class FollowUpParams(TicketParams):
    instruction: str = Field(min_length=1, max_length=64 * 1024)


class RetryParams(TicketParams):
    from_node: str = Field("", max_length=100)


class WatchParams(TicketParams):
    from_seq: int = Field(0, ge=0, le=2 ** 62)
    follow: bool = True


class PullParams(_Params):
    workspace: Annotated[str, Field(min_length=1, max_length=100), _matching(_NAME, "must be a workspace name")]
    number: Annotated[str, Field(min_length=1, max_length=20), _matching(_PR_NUMBER, "must be a pull request number")]


class UnwatchParams(_Params):
    subscription: str = Field(max_length=32)


METHODS: dict[str, type[_Params]] = {
    "tickets.create": CreateParams,
    "tickets.list": ListParams,
    "tickets.get": TicketParams,
    "tickets.diff": TicketParams,
    "tickets.records": TicketParams,
    "keys.get": NoParams,
    "tickets.cancel": TicketParams,
    "tickets.approve": ApproveParams,
    "tickets.reject": RejectParams,
    "tickets.followup": FollowUpParams,
    "tickets.retry": RetryParams,
    "tickets.updateBranch": TicketParams,
    "tickets.watch": WatchParams,
    "tickets.unwatch": UnwatchParams,
    "pulls.get": PullParams,
    "workflows.list": NoParams,
    "workspaces.list": NoParams,
    "session.info": NoParams,
}


def parse_params(method: str, params: Any) -> dict[str, Any]:
    """Checked params of `method` with defaults filled in; a null field counts as absent."""
    return validate_params(method, params).model_dump()


def validate_params(method: str, params: Any) -> BaseModel:
    """Checked params of `method` as its model, `METHODS[method]`, with defaults filled in;
    a null field counts as absent."""
    model = METHODS[method]
    if params is None:
        params = {}
    if isinstance(params, list):
        raise InvalidArgument("params must be an object with named fields, not a list")
    if not isinstance(params, dict):
        raise InvalidArgument("params must be an object")
    unknown = sorted(set(params) - set(model.model_fields))
    if unknown:
        allowed = ", ".join(sorted(model.model_fields)) or "none"
        raise InvalidArgument(f"unknown field(s) {', '.join(repr(u) for u in unknown)}; allowed: {allowed}")
    given = {k: v for k, v in params.items() if v is not None}
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        raise InvalidArgument(problem(exc)) from None

