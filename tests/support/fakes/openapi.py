"""Checks requests against GitHub's official REST description (the
`@octokit/openapi` npm package): a fake GitHub that is given an `OpenApi`
records every request that the description does not document (method +
path template, required query parameters, required JSON body fields), and
the test fails on any of them. So afe only ever makes calls GitHub has."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs


@dataclass(frozen=True)
class Operation:
    method: str
    template: str
    pattern: re.Pattern[str]
    required_query: tuple[str, ...]
    required_body: tuple[str, ...]


class OpenApi:
    def __init__(self, description: Path) -> None:
        doc = json.loads(description.read_text())
        self.ops: list[Operation] = []
        for template, item in doc["paths"].items():
            shared = item.get("parameters", [])
            regex = "^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$"
            for method, op in item.items():
                if method not in ("get", "put", "post", "patch", "delete", "head"):
                    continue
                params = [self._ref(doc, p) for p in (*shared, *op.get("parameters", []))]
                query = tuple(p["name"] for p in params if p.get("in") == "query" and p.get("required"))
                body: tuple[str, ...] = ()
                schema = (((op.get("requestBody") or {}).get("content") or {}).get("application/json") or {})
                schema = self._ref(doc, schema.get("schema") or {})
                if isinstance(schema.get("required"), list):
                    body = tuple(schema["required"])
                self.ops.append(Operation(method.upper(), template, re.compile(regex), query, body))

    @staticmethod
    def _ref(doc: dict, obj: dict) -> dict:
        while isinstance(obj, dict) and "$ref" in obj:
            node: object = doc
            for part in obj["$ref"].lstrip("#/").split("/"):
                node = node[part]  # type: ignore[index]
            obj = node  # type: ignore[assignment]
        return obj

    def problem(self, method: str, path: str, query: str, body: bytes) -> str | None:
        """None when GitHub documents the request, else what is wrong."""
        found = [op for op in self.ops if op.pattern.match(path)]
        if not found:
            return f"{method} {path}: no such path in GitHub's REST description"
        # The most specific template (fewest parameters) wins, like GitHub's router.
        ops = [op for op in found if op.method == method]
        if not ops:
            return f"{method} {path}: GitHub documents only {sorted({o.method for o in found})} here"
        op = min(ops, key=lambda o: o.template.count("{"))
        q = parse_qs(query)
        missing = [n for n in op.required_query if n not in q]
        if missing:
            return f"{method} {op.template}: missing required query parameter(s) {missing}"
        if op.required_body:
            try:
                data = json.loads(body or b"null")
            except ValueError:
                return f"{method} {op.template}: the body is not JSON"
            if not isinstance(data, dict) or any(k not in data for k in op.required_body):
                return f"{method} {op.template}: the body lacks required field(s) {list(op.required_body)}"
        return None
