"""Ticket creation input: the checks that refuse bad input before anything
is stored, and ticket ids.

The limits of a title, body and inputs are `services.common.schema.tickets.
TicketText`, the same model the gateway and the CLI check (a title is 1-200
characters, a body at most 64 KiB of UTF-8, at most 64 inputs of at most
8 KiB each); here too every text must be valid UTF-8 and input names must be
declared by the workflow's `inputs`, and every declared input without a
default must be set (a default fills an input the ticket leaves out).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from services.common.config.model import Config, Workflow, Workspace
from services.common.errors import InvalidArgument
from services.common.layout import new_ticket_id
from services.common.schema.tickets import (
    MAX_BODY_BYTES,
    MAX_INPUT_BYTES,
    MAX_TITLE_CHARS,
    TicketText,
    problem,
)

__all__ = ["MAX_BODY_BYTES", "MAX_INPUT_BYTES", "MAX_TITLE_CHARS", "NewTicket", "new_ticket_id", "validate"]

MAX_PRINCIPAL_CHARS = 200




def _utf8(value: object, what: str) -> bytes:
    if isinstance(value, bytes):
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(f"{what} is not valid UTF-8; send UTF-8 text") from None
        return value
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be text")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what} is not valid UTF-8; send UTF-8 text") from None


def _str(value: str | bytes) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


@dataclass(frozen=True)
class NewTicket:
    workspace: Workspace
    workflow: Workflow
    title: str
    body: str
    inputs: dict[str, str]
    principal: str


def validate(config: Config, workspace: str, workflow: str, title: str, body: str,
             inputs: dict[str, str], principal: str) -> NewTicket:
    for value, what in ((workspace, "workspace"), (workflow, "workflow"), (title, "title"),
                        (body, "body"), (principal, "principal")):
        _utf8(value, what)
    wf = config.workflows.get(workflow)
    if wf is None:
        known = ", ".join(sorted(config.workflows)) or "none"
        raise InvalidArgument(f"unknown workflow {workflow!r}; known workflows: {known}")
    ws_name = workspace or wf.workspace or ""
    if not ws_name:
        raise InvalidArgument(f"workflow {workflow!r} names no workspace; set the ticket's workspace")
    ws = config.workspaces.get(ws_name)
    if ws is None:
        known = ", ".join(sorted(config.workspaces)) or "none"
        raise InvalidArgument(f"unknown workspace {ws_name!r}; known workspaces: {known}")
    for name, value in (inputs or {}).items():
        _utf8(name, "an input name")
        _utf8(value, f"input {name!r}")
    try:
        text = TicketText.model_validate({"title": _str(title), "body": _str(body),
                                          "inputs": {_str(k): _str(v) for k, v in (inputs or {}).items()}})
    except ValidationError as exc:
        raise InvalidArgument(problem(exc)) from None
    declared = set(wf.inputs)
    for name in text.inputs:
        if name not in declared:
            listed = ", ".join(sorted(declared)) or "none"
            raise InvalidArgument(f"unknown input {name!r} for workflow {workflow!r}; declared inputs: {listed}")
    missing = [n for n in wf.required_inputs if not text.inputs.get(n)]
    if missing:
        raise InvalidArgument(f"workflow {workflow!r} needs the input(s) {', '.join(missing)}; set them "
                              f"(afe ticket create --input {missing[0]}=VALUE) or give them a default in "
                              "the workflow's inputs")
    text.inputs.update({k: v for k, v in wf.input_defaults if not text.inputs.get(k)})
    principal = (principal or "").strip() or "unknown"
    if len(principal) > MAX_PRINCIPAL_CHARS:
        raise InvalidArgument("the principal name is too long")
    return NewTicket(ws, wf, text.title, text.body, text.inputs, principal)
