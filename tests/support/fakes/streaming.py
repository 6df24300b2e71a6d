"""One fake model server speaking the four APIs the relay forwards (R32),
streamed (SSE) and not: Anthropic Messages, OpenAI Chat Completions and
Responses, Gemini generateContent / streamGenerateContent. It checks the
provider's key header, records every request (`seen`, from FakeServer) and
answers `pieces` text pieces with fixed usage figures.

`first_delay_s` / `piece_delay_s` make it think (the relay benchmark), and
`hold` (an asyncio.Event) parks a stream after its first piece until the
test sets it: a client that receives the first piece while the server is
parked proves the relay does not buffer whole answers.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from .base import FakeServer

IN_TOKENS = 21
OUT_TOKENS = 8


class FakeModelAPI(FakeServer):
    def __init__(self, key: str, *, pieces: int = 4, first_delay_s: float = 0.0, piece_delay_s: float = 0.0) -> None:
        super().__init__()
        self.key = key
        self.pieces = pieces
        self.first_delay_s = first_delay_s
        self.piece_delay_s = piece_delay_s
        self.hold: asyncio.Event | None = None
        self.parked = asyncio.Event()

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self.anthropic)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1beta/models/{call}", self.gemini)
        app.router.add_get("/v1/models", self.models)

    def text(self, i: int) -> str:
        return f"piece{i} "

    async def _auth(self, request: web.Request, header: str, expect: str) -> web.Response | None:
        if request.headers.get(header) != expect:
            return web.json_response({"error": {"message": "invalid key", "type": "authentication_error"}},
                                     status=401)
        return None

    async def _sse(self, request: web.Request, events) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if self.first_delay_s:
            await asyncio.sleep(self.first_delay_s)
        for n, (name, doc) in enumerate(events):
            line = (f"event: {name}\n" if name else "") + f"data: {doc if isinstance(doc, str) else json.dumps(doc)}\n\n"
            await resp.write(line.encode())
            if n == 0 and self.hold is not None:
                self.parked.set()
                await self.hold.wait()
            if self.piece_delay_s:
                await asyncio.sleep(self.piece_delay_s)
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake-model"}]})

    async def anthropic(self, request: web.Request) -> web.StreamResponse:
        bad = await self._auth(request, "x-api-key", self.key)
        if bad:
            return bad
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"type": "message", "model": body.get("model"), "role": "assistant",
                                      "content": [{"type": "text", "text": "".join(self.text(i) for i in range(self.pieces))}],
                                      "stop_reason": "end_turn",
                                      "usage": {"input_tokens": IN_TOKENS, "output_tokens": OUT_TOKENS}})
        events = [("message_start", {"type": "message_start", "message": {
            "model": body.get("model"), "usage": {"input_tokens": IN_TOKENS, "output_tokens": 1}}})]
        events += [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "text_delta", "text": self.text(i)}})
                   for i in range(self.pieces)]
        events += [("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                      "usage": {"output_tokens": OUT_TOKENS}}),
                   ("message_stop", {"type": "message_stop"})]
        return await self._sse(request, events)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        bad = await self._auth(request, "Authorization", f"Bearer {self.key}")
        if bad:
            return bad
        body = await request.json()
        usage = {"prompt_tokens": IN_TOKENS, "completion_tokens": OUT_TOKENS}
        if not body.get("stream"):
            return web.json_response({"object": "chat.completion", "model": body.get("model"), "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": usage})
        events = [("", {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": self.text(i)}}]})
                  for i in range(self.pieces)]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(("", {"object": "chat.completion.chunk", "choices": [], "usage": usage}))
        events.append(("", "[DONE]"))
        return await self._sse(request, events)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        bad = await self._auth(request, "Authorization", f"Bearer {self.key}")
        if bad:
            return bad
        body = await request.json()
        usage = {"input_tokens": IN_TOKENS, "output_tokens": OUT_TOKENS, "total_tokens": IN_TOKENS + OUT_TOKENS}
        if not body.get("stream"):
            return web.json_response({"object": "response", "model": body.get("model"), "status": "completed",
                                      "usage": usage})
        events = [("response.created", {"type": "response.created", "response": {"status": "in_progress"}})]
        events += [("response.output_text.delta", {"type": "response.output_text.delta", "delta": self.text(i)})
                   for i in range(self.pieces)]
        events.append(("response.completed", {"type": "response.completed",
                                              "response": {"status": "completed", "usage": usage}}))
        return await self._sse(request, events)

    async def gemini(self, request: web.Request) -> web.StreamResponse:
        bad = await self._auth(request, "x-goog-api-key", self.key)
        if bad:
            return bad
        model, _, method = request.match_info["call"].partition(":")
        usage = {"promptTokenCount": IN_TOKENS, "candidatesTokenCount": OUT_TOKENS - 2, "thoughtsTokenCount": 2}
        chunks = [{"candidates": [{"content": {"parts": [{"text": self.text(i)}], "role": "model"}}],
                   "modelVersion": model, "usageMetadata": {"promptTokenCount": IN_TOKENS, "candidatesTokenCount": i}}
                  for i in range(self.pieces)]
        chunks[-1]["usageMetadata"] = usage
        if method == "generateContent":
            return web.json_response(chunks[-1])
        if request.query.get("alt") == "sse":
            return await self._sse(request, [("", c) for c in chunks])
        return web.json_response(chunks)
