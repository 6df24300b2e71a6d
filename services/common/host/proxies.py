"""The operator's proxy for a URL, from `http(s)_proxy` / `no_proxy` read as
curl reads them: the credential broker's HTTP clients and the MCP client
(services/common/mcpclient.py) choose the same way."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping


def proxy_for(url: str, proxies: Mapping[str, str]) -> str | None:
    """The proxy for `url` from the operator's `http(s)_proxy` / `no_proxy`
    (lower case wins, as in curl), or None for a direct connection."""
    table: dict[str, str] = {}
    for name in sorted(proxies, key=lambda n: n.islower()):   # upper case first, lower case overrides
        if proxies[name] and name.lower().endswith("_proxy"):
            table[name.lower()[:-len("_proxy")]] = proxies[name]
    parts = urllib.parse.urlsplit(url)
    chosen = table.get(parts.scheme)
    if not chosen:
        return None
    if _bypassed(parts.hostname or "", table.get("no", "")):
        return None
    return chosen


def _bypassed(host: str, no_proxy: str) -> bool:
    """`no_proxy` as curl reads it: `*`, or names matching the host or a
    parent domain (a leading dot is optional), or exact addresses."""
    host = host.lower().rstrip(".")
    for entry in no_proxy.replace(" ", ",").split(","):
        entry = entry.strip().lower().lstrip(".").rstrip(".")
        if entry.startswith("[") and "]" in entry:
            entry = entry[1:entry.index("]")]
        elif entry.count(":") == 1:
            entry = entry.split(":")[0]            # host:port -> host
        if entry == "*" or (entry and (host == entry or host.endswith("." + entry))):
            return True
    return False
