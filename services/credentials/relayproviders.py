"""How the relay speaks each provider's API (R32): the inference endpoints
it forwards (`ROUTES`, `check_route`), the request rewrite that pins the
Model's model id (`rewrite`), where the capability and the real key go in a
request, which headers cross, and refusals in the provider's own error shape."""

from __future__ import annotations

import json
import re

from aiohttp import web

from services.common.config import Model

# (method, path pattern) per provider: the inference endpoints an agent needs,
# nothing that manages the account (files, fine-tuning, keys, batches).
ROUTES: dict[str, tuple[tuple[str, re.Pattern[str]], ...]] = {
    "anthropic": (("POST", re.compile(r"v1/messages")),
                  ("POST", re.compile(r"v1/messages/count_tokens")),
                  ("GET", re.compile(r"v1/models(?:/[A-Za-z0-9._:@-]+)?"))),
    "openai": (("POST", re.compile(r"v1/chat/completions")),
               ("POST", re.compile(r"v1/responses")),
               ("POST", re.compile(r"v1/completions")),
               ("POST", re.compile(r"v1/embeddings")),
               ("GET", re.compile(r"v1/models(?:/[A-Za-z0-9._:@/-]+)?"))),
    "gemini": (("POST", re.compile(r"(?:v1|v1beta|v1alpha)/models/[A-Za-z0-9._@-]+"
                                   r":(?:generateContent|streamGenerateContent|countTokens)")),
               ("GET", re.compile(r"(?:v1|v1beta|v1alpha)/models(?:/[A-Za-z0-9._@-]+)?"))),
}
_GEMINI_MODEL = re.compile(r"^((?:v1|v1beta|v1alpha)/models/)([A-Za-z0-9._@-]+)(:.*)$")

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
        body: dict = {"type": "error", "error": {"type": kind, "message": message}}
    elif provider == "gemini":
        body = {"error": {"code": status, "message": message, "status": {
            400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
            413: "INVALID_ARGUMENT", 502: "UNAVAILABLE"}.get(status, "UNKNOWN")}}
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


def check_route(provider: str, method: str, path: str) -> None:
    for m, pattern in ROUTES.get(provider, ()):
        if m == method and pattern.fullmatch(path):
            return
    raise Refused(404, "not_found_error",
                  f"{method} /{path} is not an inference endpoint of a {provider} model; the relay forwards "
                  "only " + ", ".join(f"{m} /{p.pattern}" for m, p in ROUTES.get(provider, ())))


def rewrite(model: Model, path: str, body: bytes) -> tuple[str, bytes]:
    """Pin the Model's model id (the agent cannot pick another model) and ask
    an OpenAI chat stream for its usage."""
    if model.provider == "gemini":
        m = _GEMINI_MODEL.match(path)
        if m and model.model:
            path = f"{m[1]}{model.model}{m[3]}"
        return path, body
    if not body:
        return path, body
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
    return path, json.dumps(doc, separators=(",", ":")).encode()
