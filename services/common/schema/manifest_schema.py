"""The JSON Schema (draft 2020-12) of every manifest kind, for editors
(`afe check --schema`; e.g. yaml-language-server's `# yaml-language-server:
$schema=afe.schema.json`).

It is generated from the same pydantic models whose field names the loader
allows, so the two cannot drift apart. The schema describes each document's
shape (fields, types, patterns, enums); `afe check` alone also checks what a
schema cannot say: references between documents, files on disk, and the
secret scan (R28)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from .agent import AgentManifest
from .mcp import McpServerManifest
from .model import ModelManifest
from .trigger import TriggerManifest
from .workflow import WorkflowManifest
from .workspace import WorkspaceManifest

__all__ = ["MANIFEST_MODELS", "manifest_json_schema"]

DRAFT = "https://json-schema.org/draft/2020-12/schema"
MANIFEST_MODELS = (WorkspaceManifest, ModelManifest, AgentManifest, McpServerManifest, WorkflowManifest,
                   TriggerManifest)

Manifest = Annotated[WorkspaceManifest | ModelManifest | AgentManifest | McpServerManifest | WorkflowManifest
                     | TriggerManifest,
                     Field(discriminator="kind")]


def manifest_json_schema() -> dict[str, Any]:
    """One schema that accepts any single manifest document (selected by `kind`)."""
    schema = TypeAdapter(Manifest).json_schema(by_alias=True)
    return {"$schema": DRAFT, "title": "afe manifest",
            "description": "One document of an afe config folder: kind Workspace, Model, Agent, McpServer, "
                           "Workflow or Trigger. `afe check` also checks references between documents and refuses "
                           "secret-looking values (R28).",
            **schema}
