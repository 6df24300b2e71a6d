"""An ACP message transport over the sandbox broker's interactive Process.

The agent runs inside the ticket's sandbox; its stdin/stdout are the
bidirectional `Process` stream of the sandbox broker. This module frames
that byte stream into newline-delimited JSON-RPC messages for the SDK's
`Connection` (it implements `acp._transport.Transport`: send / receive /
close) and is where an untrusted agent's bytes are first judged:

- a message longer than `max_message_bytes` ends the node
  (ResourceExhausted) without ever being buffered whole;
- a line that is not a JSON-RPC 2.0 object is a protocol error; after
  `max_garbage` of them the node ends (FailedPrecondition);
- more than `max_inflight` of the agent's requests waiting for an answer
  ends the node (ResourceExhausted): each one holds a task in the scheduler;
  so does an agent that leaves more than MAX_UNREAD_STDIN bytes unread;
- stderr goes to `on_stderr` (the runner records it, bounded, as
  `agent.stderr` events that the scheduler's event pipeline redacts; it is
  never logged: it may hold whatever the agent prints, even its own key);
- the process's exit or the stream's failure is EOF for the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services._gen.afe.sandbox.v1 import sandbox_pb2
from services.common.errors import AfeError, FailedPrecondition, ResourceExhausted, Unavailable
from services.common.rpc.grpcutil import error_from_rpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8 * 1024 * 1024   # room for a 4 MiB file write plus JSON escaping
MAX_GARBAGE = 3
MAX_INFLIGHT = 64          # agent requests we have not answered yet
MAX_UNREAD_STDIN = 32 * 1024 * 1024   # bytes written for the agent that the broker has not taken
QUEUE_DEPTH = 256

ProtocolErrorSink = Callable[[str], Awaitable[None]]
StderrSink = Callable[[bytes], None]


def check_jsonrpc(message: Any) -> str | None:
    """Why `message` is not an acceptable JSON-RPC 2.0 message, or None."""
    if not isinstance(message, dict):
        return "message is not a JSON object"
    if message.get("jsonrpc") != "2.0":
        return "message lacks jsonrpc: \"2.0\""
    has_id = "id" in message
    if has_id:
        mid = message["id"]
        if isinstance(mid, bool) or not (mid is None or isinstance(mid, (int, str))):
            return "message id must be a number, a string or null"
        if isinstance(mid, str) and len(mid) > 256:
            return "message id is longer than 256 characters"
    if "method" in message:
        if not isinstance(message["method"], str) or not message["method"]:
            return "method must be a non-empty string"
        params = message.get("params")
        if params is not None and not isinstance(params, (dict, list)):
            return "params must be an object or an array"
        return None
    if not has_id:
        return "message is neither a request, a notification nor a response"
    if "result" not in message and "error" not in message:
        return "response has neither result nor error"
    if "error" in message and not isinstance(message["error"], dict):
        return "response error must be an object"
    return None


class ProcessTransport:
    """acp Transport speaking newline-delimited JSON over a sandbox Process."""

    def __init__(
        self,
        sandbox: Any,
        start: sandbox_pb2.ProcessStart,
        *,
        on_protocol_error: ProtocolErrorSink,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_garbage: int = MAX_GARBAGE,
        known_methods: frozenset[str] = frozenset(),
        max_inflight: int = MAX_INFLIGHT,
        on_stderr: StderrSink | None = None,
    ) -> None:
        self._on_stderr = on_stderr
        self._known = known_methods
        self._max_inflight = max_inflight
        self._inflight: set[tuple[str, object]] = set()
        self._unread = 0
        self._sandbox = sandbox
        self._start = start
        self._on_protocol_error = on_protocol_error
        self._max = max_message_bytes
        self._max_garbage = max_garbage
        self._inputs: asyncio.Queue[sandbox_pb2.ProcessInput | None] = asyncio.Queue()
        self._messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(QUEUE_DEPTH)
        self._started: asyncio.Future[None] | None = None
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._exited = asyncio.Event()
        self._closed = False
        self._dead = False            # stdout no longer parsed (after a failure)
        self._killed = False
        self.exit: sandbox_pb2.ExecExit | None = None
        self.failure: AfeError | None = None
        self.garbage = 0
        self.stderr_bytes = 0

    # -- lifecycle ---------------------------------------------------------

    async def open(self) -> None:
        """Start the process; return once the broker says it is running."""
        loop = asyncio.get_running_loop()
        self._started = loop.create_future()
        self._inputs.put_nowait(sandbox_pb2.ProcessInput(start=self._start))
        self._call = self._sandbox.Process(self._requests())
        self._reader = asyncio.create_task(self._read_loop(), name="acp.transport.read")
        await asyncio.shield(self._started)

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    async def wait_exit(self, timeout: float) -> bool:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._exited.wait(), timeout)
        return self._exited.is_set()

    def kill(self) -> None:
        """Ask the broker to kill the process (idempotent, never blocks)."""
        if self._killed or self._exited.is_set() or self._call is None:
            return
        self._killed = True
        self._inputs.put_nowait(sandbox_pb2.ProcessInput(kill=True))

    def abort(self) -> None:
        """Synchronous last resort: cancel the stream (the broker kills the process)."""
        self._closed = True
        if self._started is not None and not self._started.done():
            self._started.cancel()
        if self._call is not None and not self._exited.is_set():
            self._call.cancel()
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()

    # -- Transport ---------------------------------------------------------

    async def send(self, message: dict[str, Any]) -> None:
        if self._closed or self._exited.is_set() or self._dead:
            if "method" not in message:
                return      # an answer to a request of an agent that is gone: moot
            raise ConnectionError("agent process is not running")
        if "method" not in message and "id" in message:      # our answer to an agent request
            self._inflight.discard(_key(message["id"]))
        data = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
        self._unread += len(data)
        if self._unread > MAX_UNREAD_STDIN:
            self._fail(ResourceExhausted(
                f"the agent left more than {MAX_UNREAD_STDIN} bytes of its stdin unread; the node was stopped"))
            if "method" not in message:
                return
            raise ConnectionError("agent is not reading its stdin")
        self._inputs.put_nowait(sandbox_pb2.ProcessInput(stdin=data))

    async def receive(self) -> dict[str, Any] | None:
        return await self._messages.get()

    async def close(self) -> None:
        """Kill the process if still running and end the stream."""
        if self._closed:
            return
        self._closed = True
        self.kill()
        if not await self.wait_exit(5.0):
            log.warning("agent process did not report its exit after kill; cancelling the stream")
        self._inputs.put_nowait(None)
        self.abort()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader

    # -- internals ---------------------------------------------------------

    async def _requests(self) -> AsyncIterator[sandbox_pb2.ProcessInput]:
        while True:
            item = await self._inputs.get()
            if item is None:
                return
            if item.WhichOneof("input") == "stdin":
                self._unread -= len(item.stdin)
            yield item

    def _fail(self, error: AfeError) -> None:
        if self.failure is None:
            self.failure = error
        self._dead = True
        self.kill()
        self._eof()

    def _eof(self) -> None:
        # Unblock the receiver even if the queue is full: drop what is queued.
        while True:
            try:
                self._messages.put_nowait(None)
                return
            except asyncio.QueueFull:
                with contextlib.suppress(asyncio.QueueEmpty):
                    self._messages.get_nowait()

    async def _read_loop(self) -> None:
        buf = bytearray()
        try:
            async for out in self._call:
                kind = out.WhichOneof("output")
                if kind == "started":
                    self._set_started()
                elif kind == "stdout":
                    self._set_started()
                    if self._dead:
                        continue
                    buf += out.stdout
                    while not self._dead:
                        nl = buf.find(b"\n")
                        if nl < 0:
                            break
                        line = bytes(buf[:nl])
                        del buf[: nl + 1]
                        await self._on_line(line)
                    if not self._dead and len(buf) > self._max:
                        buf.clear()
                        await self._protocol_error(f"message longer than {self._max} bytes")
                        self._fail(ResourceExhausted(
                            f"the agent sent a JSON-RPC message longer than {self._max} bytes; "
                            "the node was stopped"))
                elif kind == "stderr":
                    self.stderr_bytes += len(out.stderr)
                    if self._on_stderr is not None:
                        self._on_stderr(out.stderr)
                elif kind == "exit":
                    self.exit = out.exit
                    self._exited.set()
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            if not self._closed:
                err = error_from_rpc(exc)
                if self._started is not None and not self._started.done():
                    self._started.set_exception(err)
                elif self.failure is None and self.exit is None:
                    self.failure = Unavailable(f"the sandbox broker ended the agent process stream: {err}")
        except Exception as exc:  # never let a broken stream crash the scheduler
            log.exception("agent process stream failed")
            if self.failure is None:
                self.failure = Unavailable(f"the agent process stream failed: {type(exc).__name__}")
        finally:
            self._exited.set()
            if self._started is not None and not self._started.done():
                self._started.set_exception(Unavailable(
                    "the agent process ended before it started; check the agent's command and image"))
            if not self._dead and not self._closed and buf.strip() and self.failure is None:
                await self._on_line(bytes(buf))
            self._eof()

    def _set_started(self) -> None:
        if self._started is not None and not self._started.done():
            self._started.set_result(None)

    async def _protocol_error(self, reason: str) -> None:
        try:
            await self._on_protocol_error(reason)
        except Exception:
            log.exception("recording an agent protocol error failed")

    async def _on_line(self, line: bytes) -> None:
        line = line.strip()
        if not line:
            return
        if len(line) > self._max:
            await self._protocol_error(f"message longer than {self._max} bytes")
            self._fail(ResourceExhausted(
                f"the agent sent a JSON-RPC message longer than {self._max} bytes; the node was stopped"))
            return
        try:
            message = json.loads(line)
            reason = check_jsonrpc(message)
        except (ValueError, RecursionError):
            reason = "line is not valid JSON"
            message = None
        if reason is not None:
            self.garbage += 1
            await self._protocol_error(reason)
            if self.garbage >= self._max_garbage:
                self._fail(FailedPrecondition(
                    f"the agent broke the ACP protocol ({reason}; {self.garbage} bad messages); "
                    "its stdout must carry only JSON-RPC 2.0 messages, one per line"))
            return
        method = message.get("method")
        if self._known and method is not None and not method.startswith("_") and method not in self._known:
            # The SDK answers it with "method not found"; record that it was tried.
            await self._protocol_error(f"unknown method {method[:80]!r} refused")
        if method is not None and "id" in message:
            key = _key(message["id"])
            if key in self._inflight:
                await self._protocol_error("request id reused while the first request is unanswered")
                self._fail(FailedPrecondition(
                    "the agent reused a JSON-RPC request id before its first request was answered"))
                return
            self._inflight.add(key)
            if len(self._inflight) > self._max_inflight:
                await self._protocol_error(f"more than {self._max_inflight} requests in flight")
                self._fail(ResourceExhausted(
                    f"the agent had more than {self._max_inflight} requests waiting for an answer; "
                    "the node was stopped"))
                return
        await self._messages.put(message)


def _key(message_id: object) -> tuple[str, object]:
    return (type(message_id).__name__, message_id)
