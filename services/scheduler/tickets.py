"""Ticket creation input: the checks that refuse bad input before anything
is stored, and ticket ids.

Documented caps: a title is 1-500 characters, a body at most 64 KiB of
UTF-8, an input value at most 8 KiB; every text must be valid UTF-8; input
names must be declared by the workflow's `inputs`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from services.common.config import Config, Workflow, Workspace
from services.common.errors import InvalidArgument

MAX_TITLE_CHARS = 500
MAX_BODY_BYTES = 64 * 1024
MAX_INPUT_BYTES = 8 * 1024
MAX_PRINCIPAL_CHARS = 200


def new_ticket_id() -> str:
    return "t-" + secrets.token_hex(6)


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
    title = title.strip()
    if not title:
        raise InvalidArgument("the title is empty; give the ticket a title")
    if len(title) > MAX_TITLE_CHARS:
        raise InvalidArgument(f"the title is {len(title)} characters; the limit is {MAX_TITLE_CHARS}")
    size = len(_utf8(body, "body"))
    if size > MAX_BODY_BYTES:
        raise InvalidArgument(f"the body is {size} bytes; the limit is {MAX_BODY_BYTES} bytes (64 KiB)")
    clean: dict[str, str] = {}
    declared = set(wf.inputs)
    for name, value in (inputs or {}).items():
        _utf8(name, "an input name")
        if name not in declared:
            listed = ", ".join(sorted(declared)) or "none"
            raise InvalidArgument(f"unknown input {name!r} for workflow {workflow!r}; declared inputs: {listed}")
        if len(_utf8(value, f"input {name!r}")) > MAX_INPUT_BYTES:
            raise InvalidArgument(f"input {name!r} is over {MAX_INPUT_BYTES} bytes")
        clean[name] = value
    principal = (principal or "").strip() or "unknown"
    if len(principal) > MAX_PRINCIPAL_CHARS:
        raise InvalidArgument("the principal name is too long")
    return NewTicket(ws, wf, title, body, clean, principal)
