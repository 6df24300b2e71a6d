"""The contracts of afe's inputs, each declared once with pydantic v2:

- the manifests of a config folder, one module per kind (`workspace`,
  `model`, `agent`, `workflow`, `trigger`), read by `loader.load_config`
  and described for editors by `manifest_schema.manifest_json_schema`;
- the limits of a ticket's title, body and inputs (`tickets.TicketText`),
  checked by the gateway, the scheduler and the CLI;
- the params of every JSON-RPC method of the gateway (`rpc`).
"""

from __future__ import annotations

from .loader import load_config, missing_env
from .manifest_schema import manifest_json_schema
from .text import KINDS, parse_memory

__all__ = ["KINDS", "load_config", "manifest_json_schema", "missing_env", "parse_memory"]
