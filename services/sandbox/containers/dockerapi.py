"""A small asyncio client for the few Docker Engine API calls that must
stream: exec create / start (hijacked, bidirectional) / inspect.

Everything else goes through the Docker SDK (run in threads). Only a Unix
socket engine (`DOCKER_HOST=unix://...` or the default) is supported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from services.common.errors import NotFound, Unavailable
from services.sandbox.containers.execstarts import EXEC_STARTS, ExecStarts

API = "/v1.41"
DEFAULT_SOCKET = "/var/run/docker.sock"

STDOUT = 1
STDERR = 2

# How long an exec start waits for the engine to report the exec's process.
START_WAIT_S = 30.0


def engine_socket() -> str:
    host = os.environ.get("DOCKER_HOST", "")
    if not host:
        return DEFAULT_SOCKET
    if host.startswith("unix://"):
        return host[len("unix://"):]
    raise Unavailable("the sandbox broker supports a local Docker engine socket only (DOCKER_HOST=unix://...)")


class EngineError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return status, headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return bytes(out)
            out += await reader.readexactly(size)
            await reader.readexactly(2)
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return await reader.read()


def _request_bytes(method: str, path: str, body: Any | None, upgrade: bool) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    lines = [f"{method} {API}{path} HTTP/1.1", "Host: docker"]
    if upgrade:
        lines += ["Connection: Upgrade", "Upgrade: tcp"]
    else:
        lines += ["Connection: close"]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
    elif method == "POST":
        lines += ["Content-Length: 0"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


class DockerAPI:
    def __init__(self, socket_path: str | None = None, starts: ExecStarts | None = None) -> None:
        """`starts`: where an exec counts as starting until its process runs
        (execstarts.py; a freeze waits for it); the process's own by default."""
        self.socket_path = socket_path or engine_socket()
        self.starts = starts or EXEC_STARTS

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_unix_connection(self.socket_path, limit=1 << 20)
        except OSError as exc:
            raise Unavailable("the Docker engine is not reachable") from exc

    async def request(self, method: str, path: str, body: Any | None = None) -> Any:
        headers, data = await self._call(method, path, body)
        if not data:
            return None
        if headers.get("content-type", "").startswith("application/json"):
            return json.loads(data)
        return data

    async def _call(self, method: str, path: str, body: Any | None = None) -> tuple[dict[str, str], bytes]:
        reader, writer = await self._connect()
        try:
            writer.write(_request_bytes(method, path, body, upgrade=False))
            await writer.drain()
            status, headers = await _read_head(reader)
            data = await _read_body(reader, headers)
        finally:
            writer.close()
        if status >= 400:
            try:
                msg = json.loads(data).get("message", "")
            except ValueError:
                msg = data[:200].decode("utf-8", "replace")
            if status == 404:
                raise NotFound(msg or "not found")
            raise EngineError(status, msg)
        return headers, data

    async def inspect_container(self, container: str) -> dict[str, Any]:
        doc: dict[str, Any] = await self.request("GET", f"/containers/{container}/json")
        return doc

    async def wait_stopped(self, container: str) -> int:
        """Wait until the container is no longer running (however long that
        is); its exit code. NotFound when there is no such container."""
        doc = await self.request("POST", f"/containers/{container}/wait?condition=not-running")
        return int((doc or {}).get("StatusCode", -1))

    async def events(self, *, since: float, until: float, filters: dict[str, list[str]]
                     ) -> list[dict[str, Any]]:
        """The engine's events between two Unix times (`until` at most a moment
        ahead: the engine answers then)."""
        query = urlencode({"since": f"{since:.6f}", "until": f"{until:.6f}", "filters": json.dumps(filters)})
        _headers, data = await self._call("GET", f"/events?{query}")
        return [json.loads(line) for line in data.splitlines() if line.strip()]

    async def exec_create(self, container: str, argv: list[str], *, workdir: str, env: list[str],
                          stdin: bool, user: str = "") -> str:
        body = {"AttachStdin": stdin, "AttachStdout": True, "AttachStderr": True, "Tty": False,
                "Cmd": argv, "WorkingDir": workdir, "Env": env}
        if user:
            body["User"] = user
        doc = await self.request("POST", f"/containers/{container}/exec", body)
        exec_id: str = doc["Id"]
        return exec_id

    async def exec_start(self, exec_id: str, *, container: str) -> ExecStream:
        """Start exec `exec_id` of `container`; returns once the engine reports
        its process (so a freeze of the container never lands on its start)."""
        async with self.starts.start(container):
            reader, writer = await self._connect()
            try:
                writer.write(_request_bytes("POST", f"/exec/{exec_id}/start", {"Detach": False, "Tty": False},
                                            upgrade=True))
                await writer.drain()
                status, headers = await _read_head(reader)
                if status not in (101, 200):
                    data = await _read_body(reader, headers)
                    raise EngineError(status, data[:200].decode("utf-8", "replace"))
                await self._until_started(exec_id)
            except BaseException:
                writer.close()
                raise
        return ExecStream(reader, writer)

    async def _until_started(self, exec_id: str, limit_s: float = START_WAIT_S) -> bool:
        """Until the engine has the exec's process (a pid) or its exit code. The
        engine answers the start's upgrade before it runs the process, and
        holds its inspect while runc starts it, so this is mostly one call.
        False when neither came within `limit_s` (the stream is the caller's
        then, as before this wait; a freeze is no longer held back by it)."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + limit_s, 0.001
        while True:
            doc = await self.exec_inspect(exec_id)
            if doc.get("Pid") or doc.get("ExitCode") is not None:
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def exec_inspect(self, exec_id: str) -> dict[str, Any]:
        doc: dict[str, Any] = await self.request("GET", f"/exec/{exec_id}/json")
        return doc

    async def exit_code(self, exec_id: str) -> int:
        """Wait (briefly) for the engine to record the exit, then return it."""
        delay = 0.001
        for _ in range(400):
            doc = await self.exec_inspect(exec_id)
            if not doc.get("Running"):
                code = doc.get("ExitCode")
                return int(code) if code is not None else -1
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        return -1


@dataclass
class ExecStream:
    """The hijacked connection of a started exec: multiplexed output frames
    in, raw stdin bytes out."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def frame(self) -> tuple[int, bytes] | None:
        """The next (stream, payload) frame, or None at end of output."""
        try:
            head = await self.reader.readexactly(8)
        except asyncio.IncompleteReadError:
            return None
        kind, size = head[0], struct.unpack(">I", head[4:8])[0]
        try:
            data = await self.reader.readexactly(size)
        except asyncio.IncompleteReadError as exc:
            data = exc.partial
        return kind, data

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def close_stdin(self) -> None:
        if not self.writer.is_closing() and self.writer.can_write_eof():
            with contextlib.suppress(OSError):
                self.writer.write_eof()

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        """Drop the connection now: a `frame` waiting on it ends (None)."""
        self.writer.transport.abort()
