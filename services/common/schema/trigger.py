"""kind: Trigger — which GitHub events start which workflow (docs/GITHUB.md).

`TriggerManifest` declares the fields; `load` checks one document and adds a
`config.Trigger`. (`when`, not `on`: YAML reads a bare `on` key as the
boolean true.)"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from services.common.config.model import TRIGGER_FIELDS, Trigger

from .document import Doc
from .text import COMMAND_RE, GITHUB_LOGIN_RE, INPUT_RE, NAME_RE, fields_of, show

if TYPE_CHECKING:
    from .collected import Collected as Loader

_STRICT = ConfigDict(extra="forbid", populate_by_name=True)


class WhenManifest(BaseModel):
    """At least one of labels, assignees or command."""
    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})
    labels: list[str] = Field(default_factory=list, description="an issue labelled with one of these")
    assignees: list[Annotated[str, StringConstraints(pattern=GITHUB_LOGIN_RE.pattern)]] = Field(
        default_factory=list, description="an issue assigned to one of these GitHub users")
    command: Annotated[str, StringConstraints(pattern=COMMAND_RE.pattern)] | None = Field(
        None, description="a comment that starts with this word, such as /afe")


class TriggerManifest(BaseModel):
    """GitHub issues and comments that create tickets."""
    model_config = _STRICT
    kind: Literal["Trigger"]
    name: Annotated[str, StringConstraints(pattern=NAME_RE.pattern)]
    workspace: str = Field(description="a Workspace with a github forge")
    workflow: str = Field(description="the Workflow the ticket runs")
    when: WhenManifest
    inputs: dict[Annotated[str, StringConstraints(pattern=INPUT_RE.pattern)],
                 Literal[TRIGGER_FIELDS]] = Field(  # type: ignore[valid-type]
        default_factory=dict, description="workflow input -> a field of the GitHub event (untrusted, R36)")
    poll: bool = Field(False, description="poll the repository's events instead of receiving webhooks")


def load(loader: Loader, doc: Doc, d: Mapping[str, Any], name: str | None) -> None:
    doc.fields(d, "", fields_of(TriggerManifest), ("workspace", "workflow", "when"))
    workspace = doc.text(d, "workspace", "workspace", None)
    workflow = doc.text(d, "workflow", "workflow", None)
    on = doc.mapping(d, "when", "when") or {}
    doc.fields(on, "when", fields_of(WhenManifest))
    labels = doc.str_list(on, "labels", "when.labels")
    assignees = doc.str_list(on, "assignees", "when.assignees", pattern=GITHUB_LOGIN_RE,
                             what="write a GitHub user name (letters, digits and -)")
    command = doc.text(on, "command", "when.command", "", pattern=COMMAND_RE,
                       what="write a word that starts with /, such as /afe")
    if "when" in d and not (labels or assignees or command):
        doc.error("when", "starts nothing; add labels: [..], assignees: [..] or command: /afe")
    raw_inputs = doc.mapping(d, "inputs", "inputs") or {}
    inputs: list[tuple[str, str]] = []
    for k, v in raw_inputs.items():
        path = f"inputs.{k}"
        if not isinstance(k, str) or not INPUT_RE.match(k):
            doc.error("inputs", "a key is not an input name: use letters, digits and _")
            continue
        if v not in TRIGGER_FIELDS:
            doc.error(path, f"{show(v)} is not one of: {', '.join(TRIGGER_FIELDS)}")
            continue
        inputs.append((k, v))
    poll = d.get("poll", False)
    if not isinstance(poll, bool):
        doc.error("poll", "must be true or false")
        poll = False
    if doc.named and name is not None and workspace and workflow:
        loader.triggers[name] = Trigger(name=name, workspace=workspace, workflow=workflow, labels=labels,
                                      assignees=assignees, command=command or "", inputs=tuple(inputs),
                                      poll=poll, source=doc.where)

# -- cross-document checks ----------------------------------------------

