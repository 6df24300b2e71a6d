"""The gateway's own origin and the Host values it answers to.

The origin comes from configuration (`--public-url`), never from the request's
`Host` header (R22). Requests naming any other Host are refused, which stops
DNS-rebinding pages from talking to the gateway through a name they control.
"""

from __future__ import annotations

import html
import json
import urllib.parse
from dataclasses import dataclass

from services.common.errors import ConfigError

_DEFAULT_PORTS = {"http": 80, "https": 443}

# What a browser gets at a Host the gateway does not serve (R38 still refuses the request: 421,
# nothing of afe's): a page naming the URL to open. No style or script (the CSP allows neither
# inline, and this Host gets none of the gateway's files).
_WRONG_HOST_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="referrer" content="no-referrer">
<title>afe: open the gateway at its own address</title></head>
<body>
<h1>afe is not served at this address</h1>
<p>afe's gateway answers only at the address it is configured for, so that no other web page can
reach it through a name of its own (DNS rebinding).</p>
<p>Open <a href="{url}">{url}</a> instead.</p>
<p>To use another address (for example a name on your network), start afe with
<code>--public-url</code> set to it; see docs/CLI.md, "Origin and Host".</p>
</body></html>
"""


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--listen must be HOST:PORT (e.g. 127.0.0.1:8420), not {value!r}")
    return host.strip("[]"), int(port)


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class Site:
    scheme: str
    host: str
    port: int
    allowed_hosts: frozenset[str]

    @property
    def origin(self) -> str:
        default = _DEFAULT_PORTS[self.scheme] == self.port
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}" + ("" if default else f":{self.port}")

    @property
    def secure(self) -> bool:
        return self.scheme == "https"

    @classmethod
    def build(cls, public_url: str | None, listen_host: str, listen_port: int) -> Site:
        if not public_url:
            public_url = f"http://{_netloc(listen_host, listen_port)}"
        u = urllib.parse.urlsplit(public_url)
        if u.scheme not in _DEFAULT_PORTS or not u.hostname:
            raise ConfigError(f"--public-url must be an http:// or https:// URL, not {public_url!r}")
        if u.username or u.password or u.query or u.fragment or u.path not in ("", "/"):
            raise ConfigError("--public-url must be just scheme://host[:port], without a path, "
                              "credentials, query or fragment")
        port = u.port or _DEFAULT_PORTS[u.scheme]
        host = u.hostname.lower()
        allowed = {_netloc(host, port).lower(), _netloc(listen_host, listen_port).lower()}
        if port == _DEFAULT_PORTS[u.scheme]:
            allowed.add(f"[{host}]" if ":" in host else host)
        return cls(u.scheme, host, port, frozenset(allowed))

    def wrong_host(self, accept: str | None) -> tuple[str, str]:
        """(content type, body) of the refusal of a Host the gateway does not serve, naming the
        URL to open: a page for a browser (its Accept names text/html), JSON for the others."""
        url = self.origin + "/"
        if "text/html" in (accept or "").lower():
            return "text/html", _WRONG_HOST_PAGE.format(url=html.escape(url, quote=True))
        return "application/json", json.dumps({"error": f"unknown Host; open afe at {url} (its configured public URL)",
                                               "url": url})

    def host_allowed(self, host_header: str | None) -> bool:
        return host_header is not None and host_header.strip().lower() in self.allowed_hosts

    def origin_is_ours(self, origin: str | None) -> bool:
        """Exact match with the configured origin; absent and `null` are not ours."""
        return origin is not None and origin == self.origin
