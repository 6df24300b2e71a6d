"""The scheduler's clients of the two brokers.

Thin wrappers over the generated stubs: each call turns a gRPC status back
into an `AfeError` (so the engine never imports grpc) and carries a
deadline. The raw sandbox stub is exposed as `stub` for the ACP runner.

`SandboxBroker` and `CredentialBroker` are the typed faces the engine and
the executor use; the two classes here implement them over gRPC, and the
fast tests (tests/scheduler/executor/fakes.py) implement them in process.

Each reply is bound to the type its generated stub (services/_gen) declares:
grpc has no type stubs here, so a call's result is untyped to mypy.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol

from services._gen.afe.credentials.v1 import credentials_pb2 as cpb
from services._gen.afe.credentials.v1 import credentials_pb2_grpc as cgrpc
from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services._gen.afe.sandbox.v1 import sandbox_pb2_grpc as sgrpc
from services.common.errors import FailedPrecondition, Reason
from services.common.rpc.grpcutil import TlsFiles, open_channel, open_remote_channel, rpc_errors

from ..store.base import LeaseLost
from .archive import prepared_then_chunks
from .commandstream import CommandStream, Unsupported
from .verify_client import VerificationCalls

CREDENTIALS = "the credential broker"
SANDBOX = "the sandbox broker"
SHORT = 30.0     # seconds for quick calls
LONG = 900.0     # clone, push, merge


@contextlib.asynccontextmanager
async def fenced_errors(ticket_id: str, fence: int, what: str) -> AsyncIterator[None]:
    """rpc_errors, with the credential broker's refusal of a stale fence as `LeaseLost`
    (the run stops without a write or a teardown, R37)."""
    try:
        async with rpc_errors(CREDENTIALS, what):
            yield
    except FailedPrecondition as exc:
        # The credential broker's refusal of a stale fence or an ended lease (R37, R45) carries
        # Reason.LEASE_LOST in its status details: another scheduler owns the ticket now.
        if fence and exc.reason is Reason.LEASE_LOST:
            raise LeaseLost(ticket_id) from None
        raise


class SandboxBroker(Protocol):
    """What the scheduler asks of the sandbox broker."""

    stub: Any   # the raw stub: the ACP runner drives `Process` (an agent's byte stream) on it

    def stub_for(self, ticket_id: str) -> Any: ...   # the raw stub of the broker holding the ticket's sandbox

    def creates_held(self) -> contextlib.AbstractAsyncContextManager[None]: ...
    async def create(self, ticket_id: str, spec: spb.SandboxSpec) -> spb.Sandbox: ...
    async def destroy(self, ticket_id: str) -> int: ...
    async def reconcile(self, live: list[str]) -> spb.ReconcileResponse: ...
    async def identify(self) -> str: ...
    async def freeze(self, ticket_id: str, frozen: bool) -> None: ...
    async def denied_egress(self, ticket_id: str) -> spb.DeniedEgressResponse: ...
    def exec(self, ticket_id: str, argv: list[str], timeout_ms: int = 0, output_cap_bytes: int = 0,
             cwd: str = "") -> AsyncIterator[spb.ExecEvent]: ...
    async def read_file(self, ticket_id: str, path: str, max_bytes: int = 0) -> spb.ReadFileResponse: ...
    async def write_file(self, ticket_id: str, path: str, content: bytes) -> int: ...
    async def list_dir(self, ticket_id: str, path: str) -> spb.ListDirResponse: ...
    async def search(self, ticket_id: str, pattern: str, path: str = "", regex: bool = False,
                     max_results: int = 0) -> spb.SearchResponse: ...


class CredentialBroker(Protocol):
    """What the engine and the executor ask of the credential broker (the
    GitHub intake uses more of `CredentialsClient`)."""

    async def prepare(self, ticket_id: str, workspace: str) -> cpb.PrepareWorkspaceResponse: ...
    async def commit(self, ticket_id: str, workspace: str, message: str, fence: int = 0) -> cpb.CommitResponse: ...
    async def diff(self, ticket_id: str, workspace: str, max_bytes: int) -> cpb.DiffResponse: ...
    async def push(self, ticket_id: str, workspace: str, fence: int = 0) -> cpb.PushResponse: ...
    async def release(self, ticket_id: str, workspace: str) -> None: ...
    async def checkpoint(self, ticket_id: str, workspace: str, node: str,
                         fence: int = 0) -> cpb.CheckpointWorkspaceResponse: ...
    async def restore(self, ticket_id: str, workspace: str, node: str,
                      fence: int = 0) -> cpb.CheckpointWorkspaceResponse: ...
    async def prepare_verification(self, ticket_id: str, workspace: str, sha: str, base_paths: list[str],
                                   commands: list[str]) -> cpb.PrepareVerificationResponse: ...
    async def release_verification(self, ticket_id: str, workspace: str) -> None: ...
    async def update_branch(self, ticket_id: str, workspace: str, fence: int = 0) -> cpb.UpdateBranchResponse: ...
    async def open_pr(self, ticket_id: str, workspace: str, title: str, body: str,
                      fence: int = 0) -> cpb.PullRequest: ...
    async def get_pr(self, workspace: str, number: str) -> cpb.PullRequest: ...
    async def merge(self, ticket_id: str, workspace: str, number: str, principal: str, sha: str,
                    at_ms: int, method: str = "", fence: int = 0,
                    accepted_harness_change: Sequence[str] = (),
                    expected_base_sha: str = "") -> cpb.MergePullRequestResponse: ...
    async def open_relay(self, ticket_id: str, models: list[str], budget_tokens: int,
                         mcp: Mapping[str, Sequence[str]] | None = None) -> cpb.OpenRelayResponse: ...
    async def relay_usage(self, ticket_id: str, mcp_calls_from: int = 0) -> cpb.RelayUsageResponse: ...
    async def complete(self, model: str, messages: list[cpb.Message], tools: list[cpb.ToolSpec],
                       max_tokens: int, ticket_id: str, timeout: float) -> cpb.CompleteResponse: ...
    async def sign_statement(self, ticket_id: str, statement: bytes) -> str: ...
    async def signing_key(self) -> cpb.SigningKeyResponse: ...
    async def list_mcp_tools(self, ticket_id: str, workflow: str, node: str) -> cpb.ListMcpToolsResponse: ...
    async def call_mcp_tool(self, ticket_id: str, workflow: str, node: str, server: str, tool: str,
                            arguments_json: str, fence: int, timeout: float) -> cpb.CallMcpToolResponse: ...


class SandboxClient:
    """One sandbox broker: the local one on its Unix socket, or with `tls` one
    on another host at `address` (`HOST:PORT`, mutual TLS, R39); `name` is how
    errors and logs call it."""

    def __init__(self, address: str, secret: bytes | None, *, tls: TlsFiles | None = None,
                 name: str = "") -> None:
        self.name = name or "local"
        self.address = address
        self.peer = f"the sandbox broker {name} at {address}" if name else SANDBOX
        self.channel = open_remote_channel(address, secret, tls) if tls is not None else open_channel(address, secret)
        self.stub = sgrpc.SandboxBrokerStub(self.channel)
        # every command on one open stream (commandstream.py); Exec for a broker without it
        self.commands = CommandStream(self.stub.Commands, self.peer)
        self._creates_open = asyncio.Event()
        self._creates_open.set()

    def stub_for(self, ticket_id: str) -> Any:
        """The raw stub of the broker holding the ticket's sandbox (this one)."""
        return self.stub

    async def close(self) -> None:
        self.commands.close()
        await self.channel.close()

    @contextlib.asynccontextmanager
    async def creates_held(self) -> AsyncIterator[None]:
        """New CreateSandbox calls wait inside this block, so a reconcile
        computed from the live tickets cannot remove a sandbox made meanwhile."""
        self._creates_open.clear()
        try:
            yield
        finally:
            self._creates_open.set()

    async def create(self, ticket_id: str, spec: spb.SandboxSpec) -> spb.Sandbox:
        await self._creates_open.wait()
        async with rpc_errors(self.peer, "creating the sandbox"):
            reply: spb.Sandbox = await self.stub.CreateSandbox(
                spb.CreateSandboxRequest(ticket_id=ticket_id, spec=spec), timeout=LONG)
            return reply

    async def destroy(self, ticket_id: str) -> int:
        async with rpc_errors(self.peer, "removing the sandbox"):
            r: spb.DestroySandboxResponse = await self.stub.DestroySandbox(
                spb.DestroySandboxRequest(ticket_id=ticket_id), timeout=LONG)
            return r.removed

    async def reconcile(self, live: list[str]) -> spb.ReconcileResponse:
        async with rpc_errors(self.peer):
            reply: spb.ReconcileResponse = await self.stub.Reconcile(
                spb.ReconcileRequest(live_tickets=live), timeout=LONG)
            return reply

    async def identify(self) -> str:
        """The broker process's boot id (new on each start)."""
        async with rpc_errors(self.peer, "asking which broker answers"):
            r: spb.IdentifyResponse = await self.stub.Identify(spb.IdentifyRequest(), timeout=SHORT)
            return r.boot_id

    async def freeze(self, ticket_id: str, frozen: bool) -> None:
        async with rpc_errors(self.peer):
            await self.stub.Freeze(spb.FreezeRequest(ticket_id=ticket_id, frozen=frozen), timeout=SHORT)

    async def denied_egress(self, ticket_id: str) -> spb.DeniedEgressResponse:
        """The host names the ticket's egress proxy refused (syntax-checked by the broker)."""
        async with rpc_errors(self.peer, "listing refused egress"):
            reply: spb.DeniedEgressResponse = await self.stub.DeniedEgress(
                spb.DeniedEgressRequest(ticket_id=ticket_id), timeout=SHORT)
            return reply

    async def exec(self, ticket_id: str, argv: list[str], timeout_ms: int = 0,
                   output_cap_bytes: int = 0, cwd: str = "") -> AsyncIterator[spb.ExecEvent]:
        req = spb.ExecRequest(ticket_id=ticket_id, argv=argv, timeout_ms=timeout_ms,
                              output_cap_bytes=output_cap_bytes, cwd=cwd)
        if not self.commands.unsupported:
            try:
                async for ev in self.commands.run(req):
                    yield ev
                return
            except Unsupported:
                pass                  # raised before anything ran
        call = self.stub.Exec(req)
        try:
            async with rpc_errors(self.peer, "the command"):
                async for ev in call:
                    yield ev
        finally:
            call.cancel()

    async def read_file(self, ticket_id: str, path: str, max_bytes: int = 0) -> spb.ReadFileResponse:
        async with rpc_errors(self.peer):
            reply: spb.ReadFileResponse = await self.stub.ReadFile(
                spb.ReadFileRequest(ticket_id=ticket_id, path=path, max_bytes=max_bytes), timeout=SHORT)
            return reply

    async def write_file(self, ticket_id: str, path: str, content: bytes) -> int:
        async with rpc_errors(self.peer):
            r: spb.WriteFileResponse = await self.stub.WriteFile(
                spb.WriteFileRequest(ticket_id=ticket_id, path=path, content=content, create_parents=True),
                timeout=SHORT)
            return r.size

    async def list_dir(self, ticket_id: str, path: str) -> spb.ListDirResponse:
        async with rpc_errors(self.peer):
            reply: spb.ListDirResponse = await self.stub.ListDir(
                spb.ListDirRequest(ticket_id=ticket_id, path=path), timeout=SHORT)
            return reply

    async def search(self, ticket_id: str, pattern: str, path: str = "", regex: bool = False,
                     max_results: int = 0) -> spb.SearchResponse:
        async with rpc_errors(self.peer):
            reply: spb.SearchResponse = await self.stub.Search(
                spb.SearchRequest(ticket_id=ticket_id, pattern=pattern, path=path, regex=regex,
                                  max_results=max_results),
                timeout=SHORT)
            return reply

    async def list(self) -> list[spb.Sandbox]:
        async with rpc_errors(self.peer):
            return list((await self.stub.ListSandboxes(spb.ListSandboxesRequest(), timeout=SHORT)).sandboxes)

    # -- the workspace across hosts (remoteworkspace.py) --------------------------
    async def read_workspace(self, ticket_id: str, max_bytes: int = 0) -> AsyncIterator[bytes]:
        """The ticket's workspace as tar chunks (ReadWorkspace)."""
        call = self.stub.ReadWorkspace(spb.ReadWorkspaceRequest(ticket_id=ticket_id, max_bytes=max_bytes),
                                       timeout=LONG)
        try:
            async with rpc_errors(self.peer, "reading the workspace"):
                async for msg in call:
                    yield msg.data
        finally:
            call.cancel()

    async def write_workspace(self, ticket_id: str, disk_bytes: int,
                              chunks: AsyncIterator[bytes]) -> spb.WriteWorkspaceResponse:
        """Unpack the tar chunks into the ticket's empty workspace (WriteWorkspace)."""
        async def inputs() -> AsyncIterator[spb.WriteWorkspaceInput]:
            yield spb.WriteWorkspaceInput(start=spb.WriteWorkspaceStart(ticket_id=ticket_id, disk_bytes=disk_bytes))
            async for c in chunks:
                yield spb.WriteWorkspaceInput(chunk=c)

        async with rpc_errors(self.peer, "writing the workspace"):
            reply: spb.WriteWorkspaceResponse = await self.stub.WriteWorkspace(inputs(), timeout=LONG)
            return reply


class CredentialsClient(VerificationCalls):
    def __init__(self, socket_path: str, secret: bytes | None) -> None:
        self.channel = open_channel(socket_path, secret)
        self.stub = cgrpc.CredentialBrokerStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def prepare(self, ticket_id: str, workspace: str) -> cpb.PrepareWorkspaceResponse:
        async with rpc_errors(CREDENTIALS, "preparing the workspace"):
            reply: cpb.PrepareWorkspaceResponse = await self.stub.PrepareWorkspace(
                cpb.PrepareWorkspaceRequest(ticket_id=ticket_id, workspace=workspace), timeout=LONG)
            return reply

    async def commit(self, ticket_id: str, workspace: str, message: str, fence: int = 0) -> cpb.CommitResponse:
        async with fenced_errors(ticket_id, fence, "commit"):
            reply: cpb.CommitResponse = await self.stub.Commit(
                cpb.CommitRequest(ticket_id=ticket_id, workspace=workspace, message=message, fence=fence),
                timeout=LONG)
            return reply

    async def diff(self, ticket_id: str, workspace: str, max_bytes: int) -> cpb.DiffResponse:
        async with rpc_errors(CREDENTIALS, "the diff"):
            reply: cpb.DiffResponse = await self.stub.Diff(
                cpb.DiffRequest(ticket_id=ticket_id, workspace=workspace, max_bytes=max_bytes), timeout=SHORT)
            return reply

    async def push(self, ticket_id: str, workspace: str, fence: int = 0) -> cpb.PushResponse:
        async with fenced_errors(ticket_id, fence, "push"):
            reply: cpb.PushResponse = await self.stub.Push(
                cpb.PushRequest(ticket_id=ticket_id, workspace=workspace, fence=fence), timeout=LONG)
            return reply

    async def release(self, ticket_id: str, workspace: str) -> None:
        async with rpc_errors(CREDENTIALS, "releasing the workspace"):
            await self.stub.ReleaseWorkspace(cpb.ReleaseWorkspaceRequest(ticket_id=ticket_id,
                                                                         workspace=workspace), timeout=LONG)

    async def checkpoint(self, ticket_id: str, workspace: str, node: str,
                         fence: int = 0) -> cpb.CheckpointWorkspaceResponse:
        async with fenced_errors(ticket_id, fence, "keeping the workspace's checkpoint"):
            reply: cpb.CheckpointWorkspaceResponse = await self.stub.CheckpointWorkspace(
                cpb.CheckpointWorkspaceRequest(ticket_id=ticket_id, workspace=workspace, node=node,
                                               fence=fence),
                timeout=LONG)
            return reply

    async def restore(self, ticket_id: str, workspace: str, node: str,
                      fence: int = 0) -> cpb.CheckpointWorkspaceResponse:
        async with fenced_errors(ticket_id, fence, "restoring the workspace"):
            reply: cpb.CheckpointWorkspaceResponse = await self.stub.RestoreWorkspace(
                cpb.CheckpointWorkspaceRequest(ticket_id=ticket_id, workspace=workspace, node=node,
                                               fence=fence),
                timeout=LONG)
            return reply

    # -- the workspace on another host (remoteworkspace.py) ---------------------------
    @contextlib.asynccontextmanager
    async def checkout_archive(self, ticket_id: str, workspace: str
                               ) -> AsyncIterator[tuple[cpb.PrepareWorkspaceResponse, AsyncIterator[bytes]]]:
        """PrepareWorkspace whose checkout comes as tar chunks (CheckoutArchive)."""
        call = self.stub.CheckoutArchive(cpb.PrepareWorkspaceRequest(ticket_id=ticket_id, workspace=workspace),
                                         timeout=LONG)
        async with prepared_then_chunks(call, "preparing the workspace") as (prepared, chunks):
            yield prepared, chunks

    async def archive_call(self, rpc: str, what: str, first: Any, chunks: AsyncIterator[bytes],
                           fence: int = 0) -> Any:
        """A CommitArchive/DiffArchive/ReleaseArchive call: `first` (the request), then the chunks."""
        kind = getattr(cpb, f"{rpc}Input")

        async def inputs() -> AsyncIterator[Any]:
            yield kind(request=first)
            async for c in chunks:
                yield kind(chunk=c)

        async with fenced_errors(first.ticket_id, fence, what):
            return await getattr(self.stub, rpc)(inputs(), timeout=LONG)

    async def update_branch(self, ticket_id: str, workspace: str, fence: int = 0) -> cpb.UpdateBranchResponse:
        async with fenced_errors(ticket_id, fence, "updating the branch"):
            reply: cpb.UpdateBranchResponse = await self.stub.UpdateBranch(
                cpb.UpdateBranchRequest(ticket_id=ticket_id, workspace=workspace, fence=fence), timeout=LONG)
            return reply

    async def open_pr(self, ticket_id: str, workspace: str, title: str, body: str,
                      fence: int = 0) -> cpb.PullRequest:
        async with fenced_errors(ticket_id, fence, "open_pr"):
            reply: cpb.PullRequest = await self.stub.OpenPullRequest(
                cpb.OpenPullRequestRequest(ticket_id=ticket_id, workspace=workspace, title=title, body=body,
                                           fence=fence),
                timeout=LONG)
            return reply

    async def get_pr(self, workspace: str, number: str) -> cpb.PullRequest:
        async with rpc_errors(CREDENTIALS, "the pull request lookup"):
            reply: cpb.PullRequest = await self.stub.GetPullRequest(
                cpb.GetPullRequestRequest(workspace=workspace, number=number), timeout=SHORT)
            return reply

    async def merge(self, ticket_id: str, workspace: str, number: str, principal: str, sha: str,
                    at_ms: int, method: str = "", fence: int = 0,
                    accepted_harness_change: Sequence[str] = (),
                    expected_base_sha: str = "") -> cpb.MergePullRequestResponse:
        async with fenced_errors(ticket_id, fence, "merge"):
            reply: cpb.MergePullRequestResponse = await self.stub.MergePullRequest(
                cpb.MergePullRequestRequest(
                    ticket_id=ticket_id, workspace=workspace, number=number, method=method, fence=fence,
                    expected_base_sha=expected_base_sha,
                    approval=cpb.ApprovalRecord(principal=principal, sha=sha, at_ms=at_ms,
                                                accepted_harness_change=list(accepted_harness_change))),
                timeout=LONG)
            return reply

    async def open_relay(self, ticket_id: str, models: list[str], budget_tokens: int,
                         mcp: Mapping[str, Sequence[str]] | None = None) -> cpb.OpenRelayResponse:
        grants = [cpb.RelayMcpGrant(server=k, tools=list(v)) for k, v in sorted((mcp or {}).items())]
        async with rpc_errors(CREDENTIALS, "opening the model relay"):
            reply: cpb.OpenRelayResponse = await self.stub.OpenRelay(
                cpb.OpenRelayRequest(ticket_id=ticket_id, models=models, budget_tokens=budget_tokens,
                                     mcp=grants),
                timeout=SHORT)
            return reply

    async def relay_usage(self, ticket_id: str, mcp_calls_from: int = 0) -> cpb.RelayUsageResponse:
        async with rpc_errors(CREDENTIALS, "reading the model relay's usage"):
            reply: cpb.RelayUsageResponse = await self.stub.RelayUsage(
                cpb.RelayUsageRequest(ticket_id=ticket_id, mcp_calls_from=mcp_calls_from), timeout=SHORT)
            return reply

    async def close_relay(self, ticket_id: str) -> None:
        async with rpc_errors(CREDENTIALS, "closing the model relay"):
            await self.stub.CloseRelay(cpb.CloseRelayRequest(ticket_id=ticket_id), timeout=SHORT)

    async def complete(self, model: str, messages: list[cpb.Message], tools: list[cpb.ToolSpec],
                       max_tokens: int, ticket_id: str, timeout: float) -> cpb.CompleteResponse:
        async with rpc_errors(CREDENTIALS, "a model call"):
            reply: cpb.CompleteResponse = await self.stub.Complete(
                cpb.CompleteRequest(model=model, messages=messages, tools=tools, max_tokens=max_tokens,
                                    ticket_id=ticket_id),
                timeout=timeout)
            return reply

    # GitHub intake (github_intake.py): every GitHub call goes through the credential broker.
    async def repo_permission(self, workspace: str, username: str) -> cpb.GetRepoPermissionResponse:
        async with rpc_errors(CREDENTIALS, "a GitHub permission lookup"):
            reply: cpb.GetRepoPermissionResponse = await self.stub.GetRepoPermission(
                cpb.GetRepoPermissionRequest(workspace=workspace, username=username), timeout=SHORT)
            return reply

    async def repo_events(self, workspace: str, etag: str, after_id: str = "") -> cpb.ListRepoEventsResponse:
        async with rpc_errors(CREDENTIALS, "polling GitHub events"):
            reply: cpb.ListRepoEventsResponse = await self.stub.ListRepoEvents(
                cpb.ListRepoEventsRequest(workspace=workspace, etag=etag, after_id=after_id), timeout=LONG)
            return reply

    async def comment(self, workspace: str, number: str, body: str) -> str:
        async with rpc_errors(CREDENTIALS, "a GitHub comment"):
            r: cpb.CommentPullRequestResponse = await self.stub.CommentPullRequest(
                cpb.CommentPullRequestRequest(workspace=workspace, number=number, body=body), timeout=SHORT)
        return r.url

    # Reporting back (github/report.py): comments and commit statuses, through the credential broker.
    async def upsert_comment(self, workspace: str, number: str, ticket_id: str, step: str,
                             body: str, fence: int = 0) -> cpb.UpsertIssueCommentResponse:
        async with fenced_errors(ticket_id, fence, "a GitHub report comment"):
            reply: cpb.UpsertIssueCommentResponse = await self.stub.UpsertIssueComment(
                cpb.UpsertIssueCommentRequest(workspace=workspace, number=number, ticket_id=ticket_id,
                                              step=step, body=body, fence=fence),
                timeout=LONG)
            return reply

    async def set_status(self, workspace: str, sha: str, state: str, context: str, description: str,
                         target_url: str, ticket_id: str = "", fence: int = 0) -> None:
        async with fenced_errors(ticket_id, fence, "a GitHub commit status"):
            await self.stub.SetCommitStatus(cpb.SetCommitStatusRequest(
                workspace=workspace, sha=sha, state=state, context=context, description=description,
                target_url=target_url, ticket_id=ticket_id, fence=fence), timeout=SHORT)

    async def check_details(self, workspace: str, sha: str, with_logs: bool) -> cpb.GetCheckDetailsResponse:
        """Failing CI of a commit (docs/GITHUB.md, "Failing CI"), read by the broker."""
        async with rpc_errors(CREDENTIALS, "reading a commit's GitHub checks"):
            reply: cpb.GetCheckDetailsResponse = await self.stub.GetCheckDetails(
                cpb.GetCheckDetailsRequest(workspace=workspace, sha=sha, with_logs=with_logs), timeout=LONG)
            return reply

    # The run record (R42, executor/nodes/run_record.py): signed by the broker's key.
    async def sign_statement(self, ticket_id: str, statement: bytes) -> str:
        async with rpc_errors(CREDENTIALS, "signing the run record"):
            r: cpb.SignStatementResponse = await self.stub.SignStatement(
                cpb.SignStatementRequest(ticket_id=ticket_id, statement=statement), timeout=SHORT)
        return r.envelope

    async def signing_key(self) -> cpb.SigningKeyResponse:
        async with rpc_errors(CREDENTIALS, "reading the signing key"):
            reply: cpb.SigningKeyResponse = await self.stub.SigningKey(cpb.SigningKeyRequest(), timeout=SHORT)
            return reply

    # MCP tools of model nodes (executor/nodes/mcptools.py, R43): asked and called by the broker.
    async def list_mcp_tools(self, ticket_id: str, workflow: str, node: str) -> cpb.ListMcpToolsResponse:
        async with rpc_errors(CREDENTIALS, "listing the node's MCP tools"):
            reply: cpb.ListMcpToolsResponse = await self.stub.ListMcpTools(
                cpb.ListMcpToolsRequest(ticket_id=ticket_id, workflow=workflow, node=node), timeout=LONG)
            return reply

    async def call_mcp_tool(self, ticket_id: str, workflow: str, node: str, server: str, tool: str,
                            arguments_json: str, fence: int, timeout: float) -> cpb.CallMcpToolResponse:
        async with fenced_errors(ticket_id, fence, "an MCP tool call"):
            reply: cpb.CallMcpToolResponse = await self.stub.CallMcpTool(
                cpb.CallMcpToolRequest(ticket_id=ticket_id, workflow=workflow, node=node, server=server,
                                       tool=tool, arguments_json=arguments_json, fence=fence),
                timeout=timeout)
            return reply
