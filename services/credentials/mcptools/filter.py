"""What the MCP relay lets through (R43), as functions over JSON-RPC
messages, with no I/O (relay.py does the HTTP).

From the sandbox to the server (`check_request`): a POST body is one
JSON-RPC message or a batch of them, parsed strictly (a duplicated key, a
NaN or a non-2.0 message is refused, so the server can never read another
message than the one checked) and sent on as the relay's own serialization
of what it checked, never the client's bytes. A request may be
`initialize`, `ping`, `tools/list` or `tools/call`; a notification one of
the client's few (`notifications/initialized`, ...); anything else
(resources, prompts, completion, logging, a method spelled otherwise) is
refused. A `tools/call` passes only when its `name` is, exactly, a tool the
Workflow grants on this server: no case folding, no prefix, no trimming, no
`server/tool` or `mcp__server__tool` spelling. A batch with one refused
message is refused whole, every request in it answered with an error.
`initialize` is sent with the client's capabilities emptied, so the server
asks nothing of the agent (no sampling, roots or elicitation).

From the server to the sandbox (`filter_message`): a result that lists
tools keeps only the granted ones (whatever request it answers, so a
replayed stream cannot carry others); an `initialize` result offers tools
only. Everything the server sends is re-serialized by the relay, which
masks secrets in those bytes (relay/secrets.py).

Each `tools/call` is noted (`Call`): the tool's name when it is a plain
tool name (else only its digest), the SHA-256 of its arguments as canonical
JSON, and its size; never the arguments or the result (untrusted text, R36).
`SseReader` splits a `text/event-stream` into events, bounded in size.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

JSONRPC = "2.0"
REQUESTS = ("initialize", "ping", "tools/list", "tools/call")
NOTIFICATIONS = ("notifications/initialized", "notifications/cancelled", "notifications/progress",
                 "notifications/roots/list_changed")
MAX_BATCH = 64
PLAIN_TOOL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")     # a grantable tool name (schema/text.py)
# JSON-RPC error codes: the relay's refusals of a method and of a tool (the MCP spec's "unknown tool").
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INVALID_REQUEST = -32600
PARSE_ERROR = -32700
RELAY_ERROR = -32603


class Malformed(Exception):
    """The body is not JSON-RPC the relay can check."""

    def __init__(self, message: str, code: int = INVALID_REQUEST) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):          # a key appears twice: name the first that does
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise Malformed(f"the key {k[:40]!r} appears twice in one object; send each key once",
                                PARSE_ERROR)
            seen.add(k)
    return out


def _constant(name: str) -> Any:
    raise Malformed(f"{name} is not JSON", PARSE_ERROR)


def parse(body: bytes) -> Any:
    """Strict JSON: UTF-8, no duplicated key, no NaN or Infinity."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise Malformed("the body is not UTF-8", PARSE_ERROR) from None
    try:
        return json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise Malformed(f"the body is not JSON ({exc.msg} at character {exc.pos})", PARSE_ERROR) from None
    except (ValueError, RecursionError):      # a number of thousands of digits, nesting too deep
        raise Malformed("the body is JSON the relay does not read (a huge number or deep nesting)",
                        PARSE_ERROR) from None


# One encoder each, made once (json.dumps with options builds a new encoder per call).
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True)
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def encode(doc: Any) -> bytes:
    """The relay's own serialization: compact, ASCII only."""
    return _COMPACT.encode(doc).encode()


def canonical_digest(value: Any) -> str:
    return hashlib.sha256(_CANONICAL.encode(value).encode()).hexdigest()


def id_key(value: Any) -> str:
    """A request id as a key (1 and "1" are different ids)."""
    if type(value) is int:          # exactly int (not bool): its JSON is its decimal form
        return str(value)
    return _COMPACT.encode(value)


def error(id_: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": JSONRPC, "id": id_, "error": {"code": code, "message": f"afe relay: {message}"}}


@dataclass
class Call:
    """One `tools/call` the client asked for."""

    id_key: str
    tool: str                  # the name when it is a plain tool name, else ""
    tool_sha256: str           # of the name as asked for (its JSON form when not a string)
    arguments_sha256: str
    request_bytes: int
    granted: bool = False
    reason: str = ""


@dataclass
class Checked:
    """What to do with a POST body (see `check_request`)."""

    forward: bytes = b""                 # the body to send upstream; b"" when refused
    refusal: Any = None                  # the JSON-RPC answer when refused (an object or a batch)
    status: int = 200                    # the HTTP status of the refusal
    calls: list[Call] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)     # id keys of the requests forwarded


def _show(name: Any) -> str:
    return json.dumps(name, ensure_ascii=True)[:80]


def _call(msg: dict[str, Any], tools: frozenset[str], server: str) -> Call:
    params = msg.get("params")
    name = params.get("name") if isinstance(params, dict) else None
    args = params.get("arguments") if isinstance(params, dict) else None
    c = Call(id_key=id_key(msg.get("id")), tool=name if isinstance(name, str) and PLAIN_TOOL.fullmatch(name)
             else "", tool_sha256=hashlib.sha256(
                 (name if isinstance(name, str) else _show(name)).encode("utf-8", "surrogatepass")).hexdigest(),
             arguments_sha256=canonical_digest(args), request_bytes=len(encode(msg)))
    if isinstance(name, str) and name in tools:
        c.granted = True
    else:
        c.reason = (f"tool {_show(name)} of MCP server {server!r} is not granted to this ticket's agents; the "
                    f"Workflow's mcp: grants {', '.join(sorted(tools))}")
    return c


def _check_one(msg: Any, tools: frozenset[str], server: str, calls: list[Call]) -> tuple[str, str | None]:
    """(kind, why refused or None); kind is request, notification or response."""
    if not isinstance(msg, dict):
        return "invalid", "a JSON-RPC message is an object"
    if msg.get("jsonrpc") != JSONRPC:
        return "invalid", 'a JSON-RPC message carries "jsonrpc": "2.0"'
    if "method" in msg:
        method = msg["method"]
        if "result" in msg or "error" in msg:
            return "invalid", "a message is a request or a response, not both"
        if "id" in msg:
            ident = msg["id"]
            if not (isinstance(ident, str) or (isinstance(ident, int) and not isinstance(ident, bool))):
                return "invalid", "a request's id is a string or an integer"
            if method not in REQUESTS:
                return "request", (f"method {_show(method)} is not relayed; an agent may send "
                                   f"{', '.join(REQUESTS)} to MCP server {server!r} (afe grants tools only)")
            if method == "tools/call":
                c = _call(msg, tools, server)
                calls.append(c)
                return "request", None if c.granted else c.reason
            if method == "initialize":
                params = msg.get("params")
                if not isinstance(params, dict):
                    return "request", "initialize needs params"
                params["capabilities"] = {}       # the server may ask nothing of the agent
            return "request", None
        if method not in NOTIFICATIONS:
            return "notification", (f"notification {_show(method)} is not relayed; an agent may send "
                                    f"{', '.join(NOTIFICATIONS)}")
        return "notification", None
    if "id" not in msg or ("result" in msg) == ("error" in msg):
        return "invalid", "a response carries an id and either result or error"
    return "response", None


def check_request(body: bytes, tools: frozenset[str], server: str) -> Checked:
    """Check a POST body against the grant (`tools`: the exact names granted on `server`).
    Raises `Malformed` for a body that is not JSON-RPC."""
    doc = parse(body)
    batch = isinstance(doc, list)
    msgs = doc if batch else [doc]
    if batch and not msgs:
        raise Malformed("an empty batch")
    if len(msgs) > MAX_BATCH:
        raise Malformed(f"a batch of {len(msgs)} messages is over the relay's limit of {MAX_BATCH}")
    out = Checked()
    results: list[tuple[Any, str, str | None]] = []
    for m in msgs:
        kind, why = _check_one(m, tools, server, out.calls)
        if kind == "invalid":
            raise Malformed(why or "not a JSON-RPC message")
        results.append((m, kind, why))
    refused = [(m, why) for m, _, why in results if why is not None]
    if not refused:
        out.forward = encode(doc)
        out.requests = [id_key(m["id"]) for m, kind, _ in results if kind == "request"]
        return out
    first = refused[0][1] or ""
    answers = []
    for m, kind, why in results:
        if kind != "request":
            continue
        if why is not None:
            code = INVALID_PARAMS if m.get("method") == "tools/call" else METHOD_NOT_FOUND
            answers.append(error(m["id"], code, why))
        else:
            answers.append(error(m["id"], INVALID_REQUEST, f"this batch holds a refused message ({first}); send "
                                                         "the others again without it"))
    for c in out.calls:        # nothing of a refused body reaches the server
        if c.granted:
            c.granted, c.reason = False, f"sent in a batch with a refused message ({first})"
    if not answers:            # notifications and responses only: there is no id to answer
        out.refusal, out.status = error(None, INVALID_REQUEST, first), 400
    else:
        out.refusal = answers if batch else answers[0]
    return out


def _granted_tools(items: list[Any], tools: frozenset[str]) -> list[Any]:
    return [t for t in items if isinstance(t, dict) and isinstance(t.get("name"), str) and t["name"] in tools]


def filter_message(doc: Any, tools: frozenset[str]) -> Any:
    """A message (or batch) from the server with what the grant does not allow taken out."""
    if isinstance(doc, list):
        return [filter_message(m, tools) for m in doc]
    if not isinstance(doc, dict):
        return doc
    result = doc.get("result")
    if isinstance(result, dict):
        if isinstance(result.get("tools"), list):
            result["tools"] = _granted_tools(result["tools"], tools)
        if "protocolVersion" in result and isinstance(result.get("capabilities"), dict):
            caps = result["capabilities"]
            result["capabilities"] = {k: caps[k] for k in ("tools",) if k in caps}
    return doc


def responses(doc: Any) -> list[dict[str, Any]]:
    """The responses in a message or batch from the server."""
    msgs = doc if isinstance(doc, list) else [doc]
    return [m for m in msgs if isinstance(m, dict) and "id" in m and "method" not in m]


def outcome(response: dict[str, Any]) -> str:
    """ok, tool_error (the tool ran and reported an error) or error (a JSON-RPC error)."""
    if "error" in response:
        return "error"
    result = response.get("result")
    return "tool_error" if isinstance(result, dict) and result.get("isError") is True else "ok"


@dataclass
class Event:
    data: str
    event: str = ""
    id: str | None = None
    retry: str = ""


class TooLarge(Exception):
    pass


class SseReader:
    """Splits a `text/event-stream` into events (the WHATWG rules: LF, CRLF
    or CR line ends, `data:` lines joined, comments skipped); an event over
    `max_event` bytes raises `TooLarge`."""

    def __init__(self, max_event: int) -> None:
        self.max_event = max_event
        self._buf = b""

    def feed(self, chunk: bytes) -> list[Event]:
        data = self._buf + chunk
        hold = b""
        if data.endswith(b"\r"):              # maybe the first half of a CRLF
            data, hold = data[:-1], b"\r"
        data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *blocks, rest = data.split(b"\n\n")
        if len(rest) > self.max_event:
            raise TooLarge
        self._buf = rest + hold
        return [e for e in (self._event(b) for b in blocks) if e is not None]

    def finish(self) -> list[Event]:
        """An event the stream ended without a blank line after."""
        rest, self._buf = self._buf.replace(b"\r", b"\n"), b""
        e = self._event(rest.rstrip(b"\n")) if rest.strip() else None
        return [e] if e is not None else []

    def _event(self, block: bytes) -> Event | None:
        if len(block) > self.max_event:
            raise TooLarge
        data: list[str] = []
        ev = Event(data="")
        for raw in block.split(b"\n"):
            line = raw.decode("utf-8", "replace")
            if not line or line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                data.append(value)
            elif name == "event":
                ev.event = value
            elif name == "id" and "\0" not in value:
                ev.id = value
            elif name == "retry" and value.isdigit():
                ev.retry = value
        if not data:
            return None
        ev.data = "\n".join(data)
        return ev
