"""How the relay speaks each provider's API (R32): the inference endpoints
it forwards (`ROUTES`) and the upstream path it sends for each, made of the
endpoint's fixed text and a model id only (`upstream_path`; a path that
tries to leave its endpoint is refused first, `check_raw_path`), the
request rewrite that pins the Model's model id (`rewrite`), where the
capability and the real key go in a request, which headers cross, and
refusals in the provider's own error shape."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from services.common.config.model import Model

# A model id in a path: starts with a letter or digit, so it is never a dot
# segment; Gemini's has no ':' (its method follows one).
_ID = r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,199}"
_GEMINI_ID = r"[A-Za-z0-9][A-Za-z0-9._@-]{0,199}"
_IDS = re.compile(rf"{_ID}(?:/{_ID})*")           # OpenAI-compatible servers name models org/name
_GEMINI_IDS = re.compile(_GEMINI_ID)


@dataclass(frozen=True)
class Endpoint:
    """One inference endpoint: what the client's path must be (`pattern`,
    matched whole) and the upstream path the relay sends instead, made of
    fixed text and a model id (`upstream`, with `{version}`, `{method}` and
    `{model}`: the Model's pinned id, or the client's id when it pins none)."""

    method: str
    shown: str
    pattern: re.Pattern[str]
    upstream: str
    ids: re.Pattern[str] | None = None     # the shape a model id in `{model}` must have


def _e(method: str, shown: str, pattern: str, upstream: str | None = None,
       ids: re.Pattern[str] | None = None) -> Endpoint:
    return Endpoint(method, shown, re.compile(pattern), pattern if upstream is None else upstream, ids)


_VERSION = r"(?P<version>v1|v1beta|v1alpha)"
# Per provider: the inference endpoints an agent needs, nothing that manages
# the account (files, fine-tuning, keys, batches, usage, admin).
ROUTES: dict[str, tuple[Endpoint, ...]] = {
    "anthropic": (_e("POST", "v1/messages", r"v1/messages"),
                  _e("POST", "v1/messages/count_tokens", r"v1/messages/count_tokens"),
                  _e("GET", "v1/models", r"v1/models"),
                  _e("GET", "v1/models/<id>", rf"v1/models/(?P<model>{_ID})", "v1/models/{model}", _IDS)),
    "openai": (_e("POST", "v1/chat/completions", r"v1/chat/completions"),
               _e("POST", "v1/responses", r"v1/responses"),
               _e("POST", "v1/completions", r"v1/completions"),
               _e("POST", "v1/embeddings", r"v1/embeddings"),
               _e("GET", "v1/models", r"v1/models"),
               _e("GET", "v1/models/<id>", rf"v1/models/(?P<model>{_IDS.pattern})", "v1/models/{model}", _IDS)),
    "gemini": (_e("POST", "<version>/models/<id>:generateContent|streamGenerateContent|countTokens",
                  rf"{_VERSION}/models/(?P<model>{_GEMINI_ID})"
                  r":(?P<method>generateContent|streamGenerateContent|countTokens)",
                  "{version}/models/{model}:{method}", _GEMINI_IDS),
               _e("GET", "<version>/models", rf"{_VERSION}/models", "{version}/models"),
               _e("GET", "<version>/models/<id>", rf"{_VERSION}/models/(?P<model>{_GEMINI_ID})",
                  "{version}/models/{model}", _GEMINI_IDS)),
}
# In the path as the client sent it (before decoding): a dot segment, or an
# encoded dot, slash, backslash or percent sign (double encoding).
_RAW_TRICKS = re.compile(r"(?:^|/)\.{1,2}(?:/|$)|%(?:2e|2f|5c|25)|\\", re.IGNORECASE)

# Request headers never forwarded: the client's credentials, hop-by-hop and
# framing headers (aiohttp sets its own), and proxy/forwarding information.
DROP_REQUEST = frozenset({
    "authorization", "x-api-key", "x-goog-api-key", "api-key", "cookie", "proxy-authorization",
    "host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "trailer", "upgrade",
    "accept-encoding", "expect", "forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto",
    "x-real-ip", "via", "proxy-connection"})
# Response headers passed back.
KEEP_RESPONSE = re.compile(r"^(?:content-type|cache-control|retry-after|request-id|x-request-id|"
                            r"anthropic-[a-z0-9-]+|openai-[a-z0-9-]+|x-ratelimit-[a-z0-9-]+)$")



class Refused(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


def refusal(provider: str, status: int, kind: str, message: str) -> web.Response:
    """An error in the provider's own shape, so the agent shows the message."""
    message = f"afe relay: {message}"
    if provider == "anthropic":
        body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    elif provider == "gemini":
        body = {"error": {"code": status, "message": message, "status": {
            400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
            408: "DEADLINE_EXCEEDED", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL",
            502: "UNAVAILABLE"}.get(status, "UNKNOWN")}}
    else:
        body = {"error": {"message": message, "type": kind, "code": kind}}
    return web.json_response(body, status=status)


def presented_capability(request: web.Request) -> str:
    """The credential the client sent, wherever its SDK puts an API key."""
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    for h in ("x-api-key", "x-goog-api-key", "api-key"):
        if request.headers.get(h):
            return request.headers[h].strip()
    return request.query.get("key", "")



def upstream_root(model: Model) -> str:
    """Where `/m/<name>/<path>` goes: the Model's baseUrl, for openai without
    its conventional trailing `/v1` (clients send `v1/...` themselves)."""
    base = model.base_url.rstrip("/")
    if model.provider == "openai" and base.endswith("/v1"):
        base = base[:-3]
    return base


def auth_headers(provider: str, key: str) -> dict[str, str]:
    if provider == "anthropic":
        return {"x-api-key": key}
    if provider == "gemini":
        return {"x-goog-api-key": key}
    return {"Authorization": f"Bearer {key}"}


def check_raw_path(raw_path: str) -> None:
    """Refuse a path that tries to leave its endpoint: dot segments and
    encoded dots, slashes, backslashes or percent signs, whatever the decoding."""
    path = raw_path.split("?", 1)[0]
    if _RAW_TRICKS.search(path):
        raise Refused(400, "invalid_request_error",
                      "the path holds a dot segment or an encoded dot, slash, backslash or percent sign; "
                      "send the endpoint's path as the provider's API documents it")


def upstream_path(provider: str, method: str, path: str, model: Model) -> str:
    """The upstream path for the client's `path` (after `/m/<Model>/`): the
    provider endpoint it matches, rebuilt from fixed text and a model id (the
    Model's pinned id, else the client's, of the endpoint's shape). Nothing
    else of the client's path reaches the upstream."""
    for e in ROUTES.get(provider, ()):
        m = e.pattern.fullmatch(path) if e.method == method else None
        if m is None:
            continue
        parts = m.groupdict()
        if "model" in parts:
            model_id = model.model or parts["model"]
            if e.ids is None or not e.ids.fullmatch(model_id):
                raise Refused(502, "api_error",
                              f"model {model.name!r}: its model id {model_id[:64]!r} cannot be a path segment "
                              "(letters, digits and . _ : @ - only); fix `model:` in its manifest")
            parts["model"] = model_id
        return e.upstream.format(**parts)
    raise Refused(404, "not_found_error",
                  f"{method} /{path[:200]} is not an inference endpoint of a {provider} model; the relay forwards "
                  "only " + ", ".join(f"{e.method} /{e.shown}" for e in ROUTES.get(provider, ())))


def rewrite(model: Model, path: str, body: bytes) -> bytes:
    """Pin the Model's model id in the body (the agent cannot pick another
    model; Gemini's is in the path, `upstream_path`) and ask an OpenAI chat
    stream for its usage."""
    if model.provider == "gemini" or not body:
        return body
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise Refused(400, "invalid_request_error", "the request body is not JSON") from None
    if not isinstance(doc, dict):
        raise Refused(400, "invalid_request_error", "the request body must be a JSON object")
    if model.model:
        doc["model"] = model.model
    if model.provider == "openai" and path == "v1/chat/completions" and doc.get("stream"):
        opts = doc.get("stream_options")
        doc["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return json.dumps(doc, separators=(",", ":")).encode()
