"""Token usage of model answers (R32 budget): what one JSON document or SSE
event of the four provider APIs says it used, read from an answer as it
streams past the relay."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

MAX_SSE_LINE = 1024 * 1024           # an SSE line longer than this is not parsed for usage
MAX_JSON_USAGE = 8 * 1024 * 1024     # a non-SSE answer longer than this is not parsed for usage


@dataclass
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    requests: int = 0
    refused: int = 0

    @property
    def total(self) -> int:
        return self.input_tokens + self.output_tokens



def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def usage_of(obj: Any) -> tuple[int, int] | None:
    """(input, output) tokens in one JSON document or SSE event of any of the
    four APIs: Anthropic `usage` / `message.usage` (cache tokens included),
    OpenAI chat `usage` (prompt/completion), Responses `response.usage`,
    Gemini `usageMetadata` (thoughts count as output)."""
    if not isinstance(obj, dict):
        return None
    found = None
    for holder in (obj, obj.get("message"), obj.get("response")):
        if not isinstance(holder, dict):
            continue
        u = holder.get("usage")
        if isinstance(u, dict):
            inp = (_int(u.get("input_tokens")) + _int(u.get("cache_creation_input_tokens"))
                   + _int(u.get("cache_read_input_tokens")) + _int(u.get("prompt_tokens")))
            out = _int(u.get("output_tokens")) + _int(u.get("completion_tokens"))
            found = (max(inp, found[0]), max(out, found[1])) if found else (inp, out)
    meta = obj.get("usageMetadata")
    if isinstance(meta, dict):
        inp = _int(meta.get("promptTokenCount"))
        out = _int(meta.get("candidatesTokenCount")) + _int(meta.get("thoughtsTokenCount"))
        found = (max(inp, found[0]), max(out, found[1])) if found else (inp, out)
    return found


class UsageMeter:
    """Reads the usage from an answer as it streams past (never holding a
    whole SSE answer). Counts are cumulative in every API, so the largest
    value seen per direction is the answer's usage."""

    def __init__(self, sse: bool) -> None:
        self.sse = sse
        self.input = 0
        self.output = 0
        self._line = bytearray()
        self._skip = False
        self._doc = bytearray()
        self._doc_over = False

    def _take(self, obj: Any) -> None:
        for o in (obj if isinstance(obj, list) else [obj]):
            u = usage_of(o)
            if u:
                self.input, self.output = max(self.input, u[0]), max(self.output, u[1])

    def _event_line(self, line: bytes) -> None:
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data and data != b"[DONE]":
                with contextlib.suppress(ValueError):
                    self._take(json.loads(data))

    def feed(self, chunk: bytes) -> None:
        if not self.sse:
            if not self._doc_over:
                if len(self._doc) + len(chunk) > MAX_JSON_USAGE:
                    self._doc_over = True
                    self._doc.clear()
                else:
                    self._doc += chunk
            return
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                rest = chunk[start:]
                if not self._skip:
                    if len(self._line) + len(rest) > MAX_SSE_LINE:
                        self._skip, self._line = True, bytearray()
                    else:
                        self._line += rest
                return
            if not self._skip:
                self._line += chunk[start:nl]
                self._event_line(bytes(self._line).rstrip(b"\r"))
            self._line, self._skip = bytearray(), False
            start = nl + 1

    def finish(self) -> tuple[int, int]:
        if self.sse and self._line and not self._skip:
            self._event_line(bytes(self._line))
        elif not self.sse and self._doc and not self._doc_over:
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                self._take(json.loads(self._doc))
        return self.input, self.output
