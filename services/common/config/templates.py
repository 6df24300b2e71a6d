"""Prompt and command templates: `{{ticket.title}}`, `{{ticket.body}}`,
`{{ticket.id}}`, `{{ticket.inputs.NAME}}`, `{{nodes.ID.output}}`.

One pass, no evaluation: a substituted value is data and is never expanded
again, so a ticket body holding `{{...}}` stays literal text. Nothing else
(environment, config, secrets) is reachable.

Prompts and PR text get the values as text (`render`). A `run:` command gets
them as data, never as shell code (R36): `render_command` replaces each
reference with a positional parameter (`"${1}"`, or `${1}` inside double
quotes) and returns the values as the arguments of `bash -c SCRIPT afe ARG...`,
so `$(...)`, backticks, `;` and quotes in a ticket's text reach the command
as one literal argument. A reference inside single quotes is refused by
`check`: bash could not expand it there.

`check` runs when the manifests load (`afe check`, `afe up`), so a typo such
as `{{ticket.titel}}` is refused before any ticket runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from services.common.errors import InvalidArgument

__all__ = ["MAX_ARG_BYTES", "REFERENCE_HELP", "check", "references", "render", "render_command"]

_REF = re.compile(r"\{\{\s*([A-Za-z0-9_.\-]+)\s*\}\}")
REFERENCE_HELP = "use ticket.title, ticket.body, ticket.id, ticket.inputs.NAME or nodes.ID.output"
MAX_ARG_BYTES = 120 * 1024   # Linux refuses one argument longer than 128 KiB (MAX_ARG_STRLEN)


def references(template: str) -> list[str]:
    return _REF.findall(template or "")


def check(template: str, earlier_nodes: Iterable[str], inputs: Iterable[str], where: str, *,
          command: bool = False) -> None:
    """Refuse references a template may not make. `earlier_nodes` are the nodes
    that finish before this one (its `needs`, transitively); `inputs` the
    workflow's declared inputs; `command` for a `run:` line."""
    earlier, names = set(earlier_nodes), set(inputs)
    for ref in references(template):
        parts = ref.split(".")
        if parts[:1] == ["ticket"] and len(parts) == 2 and parts[1] in ("title", "body", "id"):
            continue
        if parts[:2] == ["ticket", "inputs"] and len(parts) == 3:
            if parts[2] not in names:
                raise InvalidArgument(f"{where}: {{{{{ref}}}}} names an input the workflow does not "
                                      f"declare; declared: {', '.join(sorted(names)) or 'none'} (add it to "
                                      "the workflow's inputs)")
            continue
        if parts[:1] == ["nodes"] and len(parts) == 3 and parts[2] == "output":
            if parts[1] not in earlier:
                raise InvalidArgument(f"{where}: {{{{{ref}}}}} refers to a node that does not run "
                                      f"before this one; add it to `needs`")
            continue
        raise InvalidArgument(f"{where}: unknown template reference {{{{{ref}}}}}; {REFERENCE_HELP}")
    if command:
        for quote, ref in _command_refs(template or ""):
            if quote == "'":
                raise InvalidArgument(f"{where}: {{{{{ref}}}}} is inside single quotes, where the shell "
                                      "cannot substitute it; remove the quotes around it (the value is "
                                      "passed as one argument, quoted for you)")


def _value(parts: list[str], ticket: Mapping[str, object], outputs: Mapping[str, str]) -> str | None:
    inputs: Mapping[str, object] = ticket.get("inputs") or {}  # type: ignore[assignment]
    if parts[0] == "ticket" and len(parts) == 2 and parts[1] in ("title", "body", "id"):
        return str(ticket.get(parts[1], "") or "")
    if parts[:2] == ["ticket", "inputs"] and len(parts) == 3:
        return str(inputs.get(parts[2], "") or "")
    if parts[0] == "nodes" and len(parts) == 3 and parts[2] == "output":
        return outputs.get(parts[1], "")
    return None


def render(template: str, ticket: Mapping[str, object], outputs: Mapping[str, str]) -> str:
    """The template with each reference replaced by its value as text (prompts, PR text)."""
    def sub(m: re.Match[str]) -> str:
        v = _value(m.group(1).split("."), ticket, outputs)
        return m.group(0) if v is None else v

    return _REF.sub(sub, template or "")


def _command_refs(script: str) -> list[tuple[str, str]]:
    """(quote state, reference) of every reference in a shell line: '' outside
    quotes, '"' inside double quotes, "'" inside single quotes."""
    return [(q, m.group(1)) for q, m in _scan(script)]


def _scan(script: str) -> list[tuple[str, re.Match[str]]]:
    out: list[tuple[str, re.Match[str]]] = []
    quote, i = "", 0
    while i < len(script):
        m = _REF.match(script, i)
        if m is not None:
            out.append((quote, m))
            i = m.end()
            continue
        c = script[i]
        if c == "\\" and quote != "'":
            i += 2
            continue
        if quote == "" and c in ("'", '"'):
            quote = c
        elif quote and c == quote:
            quote = ""
        i += 1
    return out


def render_command(script: str, ticket: Mapping[str, object],
                   outputs: Mapping[str, str]) -> tuple[str, list[str]]:
    """(script, arguments) for `bash -c script afe *arguments`: every reference
    becomes a positional parameter and its value an argument (R36)."""
    args: list[str] = []
    pieces: list[str] = []
    last = 0
    for quote, m in _scan(script or ""):
        v = _value(m.group(1).split("."), ticket, outputs)
        if v is None:   # unknown reference (the loader refuses these): left as text
            continue
        if quote == "'":
            raise InvalidArgument(f"{{{{{m.group(1)}}}}} is inside single quotes in a run command; "
                                  "remove the quotes around it")
        if len(v.encode("utf-8", "replace")) > MAX_ARG_BYTES:
            raise InvalidArgument(f"the value of {{{{{m.group(1)}}}}} is larger than "
                                  f"{MAX_ARG_BYTES // 1024} KiB, too large for a command argument; have the "
                                  "earlier node write it to a file in the workspace and read the file")
        if "\0" in v:
            v = v.replace("\0", "")   # an argument cannot hold NUL
        args.append(v)
        n = len(args)
        pieces.append(script[last:m.start()])
        pieces.append(f"${{{n}}}" if quote == '"' else f'"${{{n}}}"')
        last = m.end()
    pieces.append((script or "")[last:])
    return "".join(pieces), args
