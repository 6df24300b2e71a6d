"""Prompt and command templates: `{{ticket.title}}`, `{{ticket.body}}`,
`{{ticket.inputs.NAME}}`, `{{nodes.ID.output}}`.

One pass, no evaluation: a substituted value is data and is never expanded
again, so a ticket body holding `{{...}}` stays literal text. Nothing else
(environment, config, secrets) is reachable.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from services.common.errors import InvalidArgument

_REF = re.compile(r"\{\{\s*([A-Za-z0-9_.\-]+)\s*\}\}")


def references(template: str) -> list[str]:
    return _REF.findall(template or "")


def check(template: str, earlier_nodes: Iterable[str], inputs: Iterable[str], where: str) -> None:
    """Refuse references a template may not make (at ticket creation)."""
    earlier, names = set(earlier_nodes), set(inputs)
    for ref in references(template):
        parts = ref.split(".")
        if parts[:1] == ["ticket"] and len(parts) == 2 and parts[1] in ("title", "body", "id"):
            continue
        if parts[:2] == ["ticket", "inputs"] and len(parts) == 3:
            if names and parts[2] not in names:
                raise InvalidArgument(f"{where}: {{{{{ref}}}}} names an input the workflow does not "
                                      f"declare; declared: {', '.join(sorted(names)) or 'none'}")
            continue
        if parts[:1] == ["nodes"] and len(parts) == 3 and parts[2] == "output":
            if parts[1] not in earlier:
                raise InvalidArgument(f"{where}: {{{{{ref}}}}} refers to a node that does not run "
                                      f"before this one; add it to `needs`")
            continue
        raise InvalidArgument(f"{where}: unknown template reference {{{{{ref}}}}}; use ticket.title, "
                              f"ticket.body, ticket.inputs.NAME or nodes.ID.output")


def render(template: str, ticket: Mapping[str, object], outputs: Mapping[str, str]) -> str:
    inputs: Mapping[str, object] = ticket.get("inputs") or {}  # type: ignore[assignment]

    def sub(m: re.Match[str]) -> str:
        parts = m.group(1).split(".")
        if parts[0] == "ticket" and len(parts) == 2 and parts[1] in ("title", "body", "id"):
            return str(ticket.get(parts[1], ""))
        if parts[:2] == ["ticket", "inputs"] and len(parts) == 3:
            return str(inputs.get(parts[2], ""))
        if parts[0] == "nodes" and len(parts) == 3 and parts[2] == "output":
            return outputs.get(parts[1], "")
        return m.group(0)

    return _REF.sub(sub, template or "")
