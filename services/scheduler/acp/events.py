"""ACP session updates and client-side decisions -> ticket events.

Every event goes through one ordered queue and one worker, so events keep
the order in which the agent sent them even though the SDK handles each
notification in its own task. Payloads are small: texts are clipped, runs
of message/thought chunks are coalesced, and a node records at most
`max_events` events (then one `agent.protocol_error` says the rest were
dropped). The node's output — the agent's final message — is tracked here
too: the text of the last run of `agent_message_chunk`s (a tool call or a
plan update starts a new message). The agent's stderr becomes
`agent.stderr` events through `stderr` (`stderr.py`: bounded by bytes, so
outside the event count, which would otherwise hide why an agent died).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .stderr import StderrLog

log = logging.getLogger(__name__)

Emit = Callable[[str, dict[str, Any]], Awaitable[None]]

MAX_EVENTS = 1000
MAX_TEXT = 4000            # characters per event text
MAX_OUTPUT = 64 * 1024     # characters of the final message kept as the node output
MAX_TITLE = 200
IDLE_FLUSH_S = 0.5       # pending message/thought text is recorded after this much quiet


def clip(text: object, limit: int = MAX_TITLE) -> str:
    s = text if isinstance(text, str) else ("" if text is None else str(text))
    return s if len(s) <= limit else s[: limit - 1] + "…"


def block_text(block: Any) -> str:
    """The text of an ACP content block; a placeholder for non-text blocks."""
    if getattr(block, "type", None) == "text":
        return getattr(block, "text", "") or ""
    return f"[{getattr(block, 'type', 'content')}]"


class EventLog:
    def __init__(self, emit: Emit, *, max_events: int = MAX_EVENTS) -> None:
        self._emit = emit
        self._max = max_events
        self._count = 0
        self._dropped = 0
        self._queue: asyncio.Queue[tuple[str, dict[str, Any]] | None] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        self._chunk_kind: str | None = None       # "agent.message" | "agent.thought"
        self._chunk_parts: list[str] = []
        self._chunk_len = 0
        self._message: list[str] = []              # the current (last) agent message
        self._message_len = 0
        self._message_open = False
        self.stderr = StderrLog(self._put_stderr)

    @property
    def recorded(self) -> int:
        return self._count

    @property
    def dropped(self) -> int:
        return self._dropped

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.create_task(self._run(), name="acp.events")

    def record(self, event_type: str, payload: dict[str, Any]) -> None:
        """Queue an event (synchronous, so callers keep the agent's order)."""
        if event_type not in ("agent.message", "agent.thought"):
            self._flush_chunks()
        self._put(event_type, payload)

    def _put(self, event_type: str, payload: dict[str, Any]) -> None:
        if self._count >= self._max:
            self._dropped += 1
            if self._dropped == 1:
                self._queue.put_nowait(("agent.protocol_error", {
                    "reason": f"event limit of {self._max} reached; later updates are not recorded"}))
            return
        self._count += 1
        self._queue.put_nowait((event_type, payload))

    def _put_stderr(self, event_type: str, payload: dict[str, Any]) -> None:
        self._queue.put_nowait((event_type, payload))     # bounded by StderrLog, not by the count

    # -- message / thought chunks -----------------------------------------

    def chunk(self, kind: str, text: str) -> None:
        if kind != self._chunk_kind:
            self._flush_chunks()
            self._chunk_kind = kind
        self._chunk_parts.append(text)
        self._chunk_len += len(text)
        if kind == "agent.message":
            if not self._message_open:
                self._message, self._message_len, self._message_open = [], 0, True
            if self._message_len < MAX_OUTPUT:
                self._message.append(text[: MAX_OUTPUT - self._message_len])
                self._message_len += len(self._message[-1])
        if self._chunk_len >= MAX_TEXT:
            self._flush_chunks()

    def end_message(self) -> None:
        """A tool call or plan ends the current agent message."""
        self._flush_chunks()
        self._message_open = False

    def _flush_chunks(self) -> None:
        if self._chunk_kind and self._chunk_parts:
            text = "".join(self._chunk_parts)
            self._put(self._chunk_kind, {"text": clip(text, MAX_TEXT)})
        self._chunk_kind, self._chunk_parts, self._chunk_len = None, [], 0

    def final_message(self) -> str:
        return "".join(self._message)

    # -- delivery ------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                item = await asyncio.wait_for(self._queue.get(), IDLE_FLUSH_S)
            except TimeoutError:
                # A quiet agent: show the text (and stderr lines) streamed so far.
                self._flush_chunks()
                self.stderr.flush()
                continue
            if item is None:
                return
            try:
                await self._emit(*item)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("emitting an agent event failed")

    async def close(self, timeout: float = 5.0) -> None:
        """Flush pending chunks and stderr, and deliver every queued event."""
        self._flush_chunks()
        self.stderr.flush(final=True)
        self._queue.put_nowait(None)
        if self._worker is None:
            self.start()
        assert self._worker is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._worker), timeout)
        except TimeoutError:
            log.warning("agent events were not all delivered within %ss", timeout)
            self._worker.cancel()
        except asyncio.CancelledError:
            self._worker.cancel()
            raise


def update_event(update: Any) -> tuple[str, dict[str, Any]] | None:
    """Map a non-chunk session update to (event type, payload), or None to skip."""
    kind = getattr(update, "session_update", None)
    if kind == "tool_call":
        return "agent.tool_call", {
            "id": clip(update.tool_call_id), "title": clip(update.title),
            "kind": update.kind or "other", "status": update.status or "pending"}
    if kind == "tool_call_update":
        payload: dict[str, Any] = {"id": clip(update.tool_call_id)}
        if update.status:
            payload["status"] = update.status
        if update.title:
            payload["title"] = clip(update.title)
        if update.kind:
            payload["kind"] = update.kind
        return "agent.tool_call_update", payload
    if kind == "plan":
        entries = [{"content": clip(e.content), "status": e.status, "priority": e.priority}
                   for e in update.entries[:50]]
        return "agent.plan", {"entries": entries}
    return None
