"""The gRPC face of the sandbox broker: parse, call the core, map back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any

import grpc

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services._gen.afe.sandbox.v1 import sandbox_pb2_grpc
from services.common.config.egress_rules import EgressRule
from services.common.errors import InvalidArgument
from services.common.observability.metrics import SandboxMetrics
from services.common.rpc.streamdrop import closed_with_call
from services.sandbox.commands import stream as commands
from services.sandbox.commands.execs import Exit, Output, Runner
from services.sandbox.containers.hardening import SandboxSettings, resolve_limits
from services.sandbox.egress.allowlist import path_digest
from services.sandbox.egress.denied import denied_egress
from services.sandbox.files.tools import Entry, FileTools

from .sandboxes import SandboxInfo, SandboxManager

log = logging.getLogger(__name__)

_TYPES = {"regular": pb.REGULAR, "directory": pb.DIRECTORY, "symlink": pb.SYMLINK, "other": pb.OTHER}


def _sandbox(i: SandboxInfo) -> pb.Sandbox:
    return pb.Sandbox(ticket_id=i.ticket_id, container_id=i.container_id, state=i.state, image=i.image,
                      network=i.network, proxy_container_id=i.proxy_container_id,
                      created_at_ms=i.created_at_ms, runtime=i.runtime)


def _name(name: str) -> str:
    """A file name for a proto string: a name that is not UTF-8 (surrogate-escaped
    bytes) is shown with `\\xNN` escapes instead of failing the whole reply."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _entry(e: Entry) -> pb.FileEntry:
    return pb.FileEntry(name=_name(e.name), type=_TYPES[e.type], size=e.size, mode=e.mode, mtime_ms=e.mtime_ms)


class SandboxServicer(sandbox_pb2_grpc.SandboxBrokerServicer):
    def __init__(self, sandboxes: SandboxManager, runner: Runner, files: FileTools,
                 default_image: str = "", metrics: SandboxMetrics | None = None, boot_id: str = "",
                 redact: Callable[[str], str] = str) -> None:
        self.sandboxes = sandboxes
        self.redact = redact
        self.boot_id = boot_id
        self.runner = runner
        self.files = files
        self.default_image = default_image
        self.metrics = metrics
        self._warming: set[asyncio.Task[None]] = set()

    def _live(self, infos: list[SandboxInfo]) -> None:
        if self.metrics:
            self.metrics.sandboxes_live.set(len(infos))
            self.metrics.proxies_live.set(sum(1 for i in infos if i.proxy_container_id))

    async def CreateSandbox(self, request: pb.CreateSandboxRequest, context: grpc.aio.ServicerContext) -> pb.Sandbox:
        spec = request.spec
        cpus, mem, pids = resolve_limits(spec.limits.cpus, spec.limits.memory_bytes, spec.limits.pids)
        settings = SandboxSettings(ticket_id=request.ticket_id,
                                   image=spec.image or self.default_image or SandboxSettings.image,
                                   cpus=cpus, memory_bytes=mem, pids=pids, egress=tuple(spec.egress),
                                   egress_private=tuple(spec.egress_private),
                                   disk_bytes=spec.limits.disk_bytes,
                                   env_names=tuple(spec.env_names), relay=spec.relay,
                                   runtime=spec.runtime or "runc",
                                   egress_rules=tuple(EgressRule(host=r.host, methods=tuple(r.methods),
                                                                 paths=tuple(r.paths), name=r.name,
                                                                 ignore_case=r.ignore_case)
                                                      for r in spec.egress_rules))
        t0 = time.monotonic()
        # The command supervisor starts as soon as the sandbox runs (while its
        # proxy may still be starting), so the first command does not wait for it.
        try:
            info = await self.sandboxes.create(
                settings, started=None if settings.runtime == "gvisor" else
                lambda cid: self._warm(self.runner.warm_container(request.ticket_id, cid)))
        except BaseException:
            self.runner.release(request.ticket_id)
            raise
        if self.metrics:
            self.metrics.create_seconds.labels(egress="allowlist" if settings.egress else "none").observe(
                time.monotonic() - t0)
        self._warm(self.runner.warm(info.ticket_id))   # a sandbox found as it was (a no-op when warm)
        return _sandbox(info)

    def _warm(self, warming: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(warming)
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    async def DestroySandbox(self, request: pb.DestroySandboxRequest,
                             context: grpc.aio.ServicerContext) -> pb.DestroySandboxResponse:
        self.runner.release(request.ticket_id)
        return pb.DestroySandboxResponse(removed=await self.sandboxes.destroy(request.ticket_id))

    async def ListSandboxes(self, request: pb.ListSandboxesRequest,
                            context: grpc.aio.ServicerContext) -> pb.ListSandboxesResponse:
        infos = await self.sandboxes.list_all()
        self._live(infos)
        return pb.ListSandboxesResponse(sandboxes=[_sandbox(i) for i in infos])

    async def Reconcile(self, request: pb.ReconcileRequest, context: grpc.aio.ServicerContext) -> pb.ReconcileResponse:
        r = await self.sandboxes.reconcile(list(request.live_tickets))
        for t in r.removed_tickets:
            self.runner.release(t)
        return pb.ReconcileResponse(removed_tickets=list(r.removed_tickets),
                                    removed_containers=r.removed_containers,
                                    removed_networks=r.removed_networks, boot_id=self.boot_id)

    async def Identify(self, request: pb.IdentifyRequest, context: grpc.aio.ServicerContext) -> pb.IdentifyResponse:
        return pb.IdentifyResponse(boot_id=self.boot_id, disk_cap_mode=self.sandboxes.diskcap.mode,
                                   disk_cap_why=self.sandboxes.diskcap.why)

    async def Freeze(self, request: pb.FreezeRequest, context: grpc.aio.ServicerContext) -> pb.FreezeResponse:
        await self.sandboxes.freeze(request.ticket_id, request.frozen)
        return pb.FreezeResponse()

    async def DeniedEgress(self, request: pb.DeniedEgressRequest,
                           context: grpc.aio.ServicerContext) -> pb.DeniedEgressResponse:
        got = await denied_egress(self.sandboxes, request.ticket_id)
        (hosts, truncated), (allowed, allowed_truncated) = got.denied, got.allowed
        requests, requests_truncated = got.requests
        big = 2**31 - 1
        return pb.DeniedEgressResponse(
            hosts=[pb.DeniedHost(host=h, count=min(n, big)) for h, n in hosts], truncated=truncated,
            allowed=[pb.DeniedHost(host=h, count=min(n, big)) for h, n in allowed],
            allowed_truncated=allowed_truncated,
            requests=[pb.EgressRequest(method=g.request.method, host=g.request.host, path=g.request.path,
                                       path_sha256=path_digest(g.request.path), status=g.request.status,
                                       denied=g.request.denied, reason=g.request.reason, rule=g.request.rule,
                                       bytes_out=g.bytes_out, bytes_in=g.bytes_in, count=min(g.count, big))
                      for g in requests],
            requests_truncated=requests_truncated)

    def Exec(self, request: pb.ExecRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ExecEvent]:
        return closed_with_call(context, self._exec(request))   # closed when the call ends

    async def _exec(self, request: pb.ExecRequest) -> AsyncGenerator[pb.ExecEvent, None]:
        outcome = "error"
        try:
            async for ev in self.runner.run_exec(request.ticket_id, list(request.argv), cwd=request.cwd,
                                                 timeout_ms=request.timeout_ms,
                                                 output_cap=request.output_cap_bytes, stdin=request.stdin):
                event, ended = commands.exec_event(ev)
                outcome = ended or outcome
                yield event
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self._count_exec(outcome)

    def _count_exec(self, outcome: str) -> None:
        if self.metrics:
            self.metrics.execs.labels(outcome=outcome).inc()

    def Commands(self, request_iterator: AsyncIterator[pb.CommandInput],
                 context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CommandEvent]:
        stream = commands.serve(self.runner, request_iterator, self.redact, self._count_exec)
        return closed_with_call(context, stream)   # closed when the call ends

    def Process(self, request_iterator: AsyncIterator[pb.ProcessInput],
                context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessOutput]:
        return closed_with_call(context, self._process(request_iterator))   # closed when the call ends

    async def _process(self, request_iterator: AsyncIterator[pb.ProcessInput]
                       ) -> AsyncGenerator[pb.ProcessOutput, None]:
        it = request_iterator.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("input") != "start":
            raise InvalidArgument("the first Process message must be `start`")
        s = first.start
        proc = await self.runner.start_process(s.ticket_id, list(s.argv), cwd=s.cwd,
                                               env_names=list(s.env_names), env=list(s.env))

        async def pump() -> None:
            async for msg in it:
                kind = msg.WhichOneof("input")
                if kind == "stdin":
                    await proc.write(msg.stdin)
                elif kind == "close_stdin":
                    proc.close_stdin()
                elif kind == "kill":
                    await proc.kill()
                    return
            # the caller half-closed its side: treat as EOF on stdin
            proc.close_stdin()

        pump_task = asyncio.create_task(pump())
        try:
            yield pb.ProcessOutput(started=True)
            async for ev in proc.output():
                if isinstance(ev, Output):
                    yield (pb.ProcessOutput(stdout=ev.data) if ev.stream == "stdout"
                           else pb.ProcessOutput(stderr=ev.data))
                else:
                    if proc.killed:
                        ev = Exit(code=ev.code if ev.code != 0 else -1, duration_ms=ev.duration_ms)
                    yield pb.ProcessOutput(exit=commands.exit_pb(ev))
        finally:
            pump_task.cancel()
            with contextlib.suppress(BaseException):
                await pump_task

    # -- file tools (the core is synchronous and quick: run inline) ------------
    async def ReadFile(self, request: pb.ReadFileRequest, context: grpc.aio.ServicerContext) -> pb.ReadFileResponse:
        data, size, truncated = self.files.read(request.ticket_id, request.path, request.max_bytes)
        return pb.ReadFileResponse(content=data, size=size, truncated=truncated)

    async def WriteFile(self, request: pb.WriteFileRequest, context: grpc.aio.ServicerContext) -> pb.WriteFileResponse:
        n = self.files.write(request.ticket_id, request.path, request.content,
                             create_parents=request.create_parents, mode=request.mode)
        return pb.WriteFileResponse(size=n)

    async def ListDir(self, request: pb.ListDirRequest, context: grpc.aio.ServicerContext) -> pb.ListDirResponse:
        entries, truncated = self.files.list_dir(request.ticket_id, request.path)
        return pb.ListDirResponse(entries=[_entry(e) for e in entries], truncated=truncated)

    async def Stat(self, request: pb.StatRequest, context: grpc.aio.ServicerContext) -> pb.FileEntry:
        return _entry(self.files.stat(request.ticket_id, request.path))

    async def Remove(self, request: pb.RemoveRequest, context: grpc.aio.ServicerContext) -> pb.RemoveResponse:
        await asyncio.to_thread(self.files.remove, request.ticket_id, request.path, request.recursive)
        return pb.RemoveResponse()

    async def MakeDir(self, request: pb.MakeDirRequest, context: grpc.aio.ServicerContext) -> pb.MakeDirResponse:
        self.files.mkdir(request.ticket_id, request.path, request.parents)
        return pb.MakeDirResponse()

    # -- the workspace across hosts (handover.py) -------------------------------
    def ReadWorkspace(self, request: pb.ReadWorkspaceRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WorkspaceChunk]:
        return closed_with_call(context, self._read_workspace(request))   # closed when the call ends

    async def _read_workspace(self, request: pb.ReadWorkspaceRequest
                              ) -> AsyncGenerator[pb.WorkspaceChunk, None]:
        chunks = self.sandboxes.handover.read(request.ticket_id, request.max_bytes)
        try:
            while (data := await asyncio.to_thread(next, chunks, None)) is not None:
                yield pb.WorkspaceChunk(data=data)
        finally:
            chunks.close()

    async def WriteWorkspace(self, request_iterator: AsyncIterator[pb.WriteWorkspaceInput],
                             context: grpc.aio.ServicerContext) -> pb.WriteWorkspaceResponse:
        it = request_iterator.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise InvalidArgument("WriteWorkspace needs a `start` message first") from None
        if first.WhichOneof("input") != "start":
            raise InvalidArgument("the first WriteWorkspace message must be `start`")

        async def chunks() -> AsyncGenerator[bytes, None]:
            async for msg in it:
                if msg.WhichOneof("input") != "chunk":
                    raise InvalidArgument("after `start`, WriteWorkspace takes only `chunk` messages")
                yield msg.chunk

        entries, size, existing = await self.sandboxes.handover.write(first.start.ticket_id,
                                                                      first.start.disk_bytes, chunks())
        return pb.WriteWorkspaceResponse(entries=entries, bytes=size, existing=existing)

    async def Search(self, request: pb.SearchRequest, context: grpc.aio.ServicerContext) -> pb.SearchResponse:
        matches, truncated = await asyncio.to_thread(
            self.files.search, request.ticket_id, request.pattern, request.path,
            regex=request.regex, max_results=request.max_results)
        return pb.SearchResponse(matches=[pb.SearchMatch(path=_name(m.path), line=m.line, text=m.text)
                                          for m in matches], truncated=truncated)
