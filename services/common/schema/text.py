"""What every manifest kind shares: the name patterns, sizes, how a value is
quoted in an error (`show`), and `fields_of`, which reads a pydantic
model's field names so a kind's allowed keys are declared once."""

from __future__ import annotations

import ipaddress
import re

from pydantic import BaseModel

from services.common.secrecy.redact import secret_kind

KINDS = ("Workspace", "Model", "Agent", "McpServer", "Workflow", "Trigger")

ENV_NAME_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
# A workflow input's name: in a Workflow's inputs, a Trigger's inputs and a ticket's inputs.
INPUT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
HOST_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
EGRESS_RE = re.compile(rf"^\.?(?:{HOST_LABEL}\.)*{HOST_LABEL}$")
GITHUB_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*/[A-Za-z0-9._-]+$")
GITHUB_LOGIN_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})(?:\[bot\])?$")
COMMAND_RE = re.compile(r"^/[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
# An MCP tool's name (the spec's recommended characters, without '/'), and a model node's
# `mcp:SERVER/TOOL` entry in `tools:`.
MCP_TOOL_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
MCP_NODE_TOOL_RE = re.compile(r"^mcp:([A-Za-z0-9][A-Za-z0-9._-]{0,62})/([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})$")
MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "t": 1024 ** 4}

ENV_NAME_WHAT = "write the NAME of an environment variable (A-Z, 0-9, _), never its value"
NAME_WHAT = "use 1-63 letters, digits, '.', '_' or '-'"
INPUT_WHAT = "use letters, digits and _, starting with a letter or _"


def parse_memory(value: object) -> int | None:
    """`512m`, `2g`, `1.5GiB` or a byte count -> bytes; None when not a size."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = MEMORY_RE.match(value)
        if m:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    return None


def show(value: object) -> str:
    """Quote a user-written value in an error only when it cannot be a secret."""
    text = str(value)
    if len(text) > 64 or secret_kind(text) is not None:
        return "(value hidden)"
    return repr(text)


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def fields_of(model: type[BaseModel]) -> tuple[str, ...]:
    """The keys a manifest may write for `model`, in declaration order."""
    return tuple(f.alias or name for name, f in model.model_fields.items())
