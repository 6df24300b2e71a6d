"""Thin gRPC servicer: parse, call the core, map the result. The boundary
(caller table, ticket-id logging, text decoding, error statuses) is
grpcutil.create_server's, the same for every afe service."""

from __future__ import annotations

import base64
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Literal, Protocol, TypeVar

import grpc

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from services._gen.afe.credentials.v1 import credentials_pb2_grpc as pb_grpc
from services.common.errors import InvalidArgument
from services.common.rpc.streamdrop import closed_with_call
from services.credentials.forges.base import PullRequestInfo
from services.credentials.verification import checkout as verifycheckout

from .broker import Approval, CredentialCore
from .models.base import Msg, Tool, ToolCallData

MCP_CALL_FIELDS = frozenset(pb.RelayMcpCall.DESCRIPTOR.fields_by_name)

_Request_co = TypeVar("_Request_co", covariant=True)


class _ArchiveInput(Protocol[_Request_co]):
    """A CommitArchive-like stream's message: `oneof input { request; chunk }`."""

    @property
    def request(self) -> _Request_co: ...
    @property
    def chunk(self) -> bytes: ...
    def WhichOneof(self, oneof_group: Literal["input"]) -> Literal["request", "chunk"] | None: ...


def _pr(info: PullRequestInfo) -> pb.PullRequest:
    return pb.PullRequest(number=info.number, url=info.url, head_branch=info.head_branch,
                          base_branch=info.base_branch, head_sha=info.head_sha, state=info.state,
                          merge_sha=info.merge_sha)


class CredentialBrokerServicer(pb_grpc.CredentialBrokerServicer):
    def __init__(self, core: CredentialCore) -> None:
        self.core = core

    async def PrepareWorkspace(self, request: pb.PrepareWorkspaceRequest,
                               context: grpc.aio.ServicerContext) -> pb.PrepareWorkspaceResponse:
        r = await self.core.prepare_workspace(request.ticket_id, request.workspace)
        return pb.PrepareWorkspaceResponse(base_sha=r.base_sha, branch=r.branch)

    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext) -> pb.CommitResponse:
        r = await self.core.commit(request.ticket_id, request.workspace, request.message,
                                   fence=request.fence)
        return pb.CommitResponse(sha=r.sha, changed=r.changed, files_changed=r.files_changed,
                                 nested_repositories=list(r.nested_repositories))

    async def CheckpointWorkspace(self, request: pb.CheckpointWorkspaceRequest,
                                  context: grpc.aio.ServicerContext) -> pb.CheckpointWorkspaceResponse:
        sha = await self.core.checkpoint_workspace(request.ticket_id, request.workspace, request.node,
                                                   fence=request.fence)
        return pb.CheckpointWorkspaceResponse(sha=sha, node=request.node)

    async def RestoreWorkspace(self, request: pb.CheckpointWorkspaceRequest,
                               context: grpc.aio.ServicerContext) -> pb.CheckpointWorkspaceResponse:
        sha = await self.core.restore_workspace(request.ticket_id, request.workspace, request.node,
                                                fence=request.fence)
        return pb.CheckpointWorkspaceResponse(sha=sha, node=request.node)

    async def Diff(self, request: pb.DiffRequest, context: grpc.aio.ServicerContext) -> pb.DiffResponse:
        text, truncated = await self.core.diff(request.ticket_id, request.workspace, request.max_bytes)
        return pb.DiffResponse(diff=text, truncated=truncated)

    async def Push(self, request: pb.PushRequest, context: grpc.aio.ServicerContext) -> pb.PushResponse:
        branch, sha = await self.core.push(request.ticket_id, request.workspace, fence=request.fence)
        return pb.PushResponse(branch=branch, sha=sha)

    async def ReleaseWorkspace(self, request: pb.ReleaseWorkspaceRequest,
                               context: grpc.aio.ServicerContext) -> pb.ReleaseWorkspaceResponse:
        await self.core.release_workspace(request.ticket_id, request.workspace)
        return pb.ReleaseWorkspaceResponse()

    # -- the workspace on another host (handover.py) --------------------------
    def CheckoutArchive(self, request: pb.PrepareWorkspaceRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[pb.CheckoutArchiveOutput]:
        return closed_with_call(context, self._checkout_archive(request))   # closed when the call ends

    async def _checkout_archive(self, request: pb.PrepareWorkspaceRequest
                                ) -> AsyncGenerator[pb.CheckoutArchiveOutput, None]:
        async with self.core.checkout_archive(request.ticket_id, request.workspace) as (r, chunks):
            yield pb.CheckoutArchiveOutput(prepared=pb.PrepareWorkspaceResponse(base_sha=r.base_sha, branch=r.branch))
            async for data in chunks:
                yield pb.CheckoutArchiveOutput(chunk=data)

    async def CommitArchive(self, request_iterator: AsyncIterator[pb.CommitArchiveInput],
                            context: grpc.aio.ServicerContext) -> pb.CommitResponse:
        first, chunks = await _archive_input(request_iterator, "CommitArchive")
        r = await self.core.commit_archive(first.ticket_id, first.workspace, first.message, chunks,
                                             fence=first.fence)
        return pb.CommitResponse(sha=r.sha, changed=r.changed, files_changed=r.files_changed,
                                 nested_repositories=list(r.nested_repositories))

    async def DiffArchive(self, request_iterator: AsyncIterator[pb.DiffArchiveInput],
                          context: grpc.aio.ServicerContext) -> pb.DiffResponse:
        first, chunks = await _archive_input(request_iterator, "DiffArchive")
        text, truncated = await self.core.diff_archive(first.ticket_id, first.workspace, first.max_bytes, chunks)
        return pb.DiffResponse(diff=text, truncated=truncated)

    async def ReleaseArchive(self, request_iterator: AsyncIterator[pb.ReleaseArchiveInput],
                             context: grpc.aio.ServicerContext) -> pb.ReleaseWorkspaceResponse:
        first, chunks = await _archive_input(request_iterator, "ReleaseArchive")
        await self.core.release_archive(first.ticket_id, first.workspace, chunks)
        return pb.ReleaseWorkspaceResponse()

    async def UpdateBranch(self, request: pb.UpdateBranchRequest,
                           context: grpc.aio.ServicerContext) -> pb.UpdateBranchResponse:
        head, changed, conflicts = await self.core.update_branch(request.ticket_id, request.workspace,
                                                                   fence=request.fence)
        return pb.UpdateBranchResponse(head_sha=head, changed=changed, conflicts=conflicts)

    async def OpenPullRequest(self, request: pb.OpenPullRequestRequest,
                              context: grpc.aio.ServicerContext) -> pb.PullRequest:
        return _pr(await self.core.open_pull_request(request.ticket_id, request.workspace,
                                                     request.title, request.body, fence=request.fence))

    async def GetPullRequest(self, request: pb.GetPullRequestRequest,
                             context: grpc.aio.ServicerContext) -> pb.PullRequest:
        return _pr(await self.core.get_pull_request(request.workspace, request.number))

    async def MergePullRequest(self, request: pb.MergePullRequestRequest,
                               context: grpc.aio.ServicerContext) -> pb.MergePullRequestResponse:
        approval = None
        if request.HasField("approval"):
            a = request.approval
            approval = Approval(principal=a.principal, sha=a.sha, at_ms=a.at_ms)
        r = await self.core.merge_pull_request(request.ticket_id, request.workspace, request.number,
                                               approval, request.method, fence=request.fence,
                                               expected_base_sha=request.expected_base_sha)
        return pb.MergePullRequestResponse(merged=r.merged, merge_sha=r.merge_sha,
                                           already_merged=r.already_merged)

    async def CommentPullRequest(self, request: pb.CommentPullRequestRequest,
                                 context: grpc.aio.ServicerContext) -> pb.CommentPullRequestResponse:
        url = await self.core.comment_pull_request(request.workspace, request.number, request.body,
                                             ticket_id=request.ticket_id, fence=request.fence)
        return pb.CommentPullRequestResponse(url=url)

    async def Complete(self, request: pb.CompleteRequest,
                       context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        messages = [Msg(role=m.role, content=m.content, tool_call_id=m.tool_call_id,
                        tool_calls=tuple(ToolCallData(t.id, t.name, t.arguments_json) for t in m.tool_calls))
                    for m in request.messages]
        tools = [Tool(t.name, t.description, t.parameters_json_schema) for t in request.tools]
        c = await self.core.complete(request.model, messages, tools, request.max_tokens)
        msg = pb.Message(role=c.message.role, content=c.message.content,
                         tool_calls=[pb.ToolCall(id=t.id, name=t.name, arguments_json=t.arguments_json)
                                     for t in c.message.tool_calls])
        return pb.CompleteResponse(message=msg, usage=pb.Usage(input_tokens=c.input_tokens,
                                                               output_tokens=c.output_tokens),
                                   stop_reason=c.stop_reason)


    async def OpenRelay(self, request: pb.OpenRelayRequest,
                        context: grpc.aio.ServicerContext) -> pb.OpenRelayResponse:
        mcp = {g.server: list(g.tools) for g in request.mcp}
        if len(mcp) != len(request.mcp):
            raise InvalidArgument("OpenRelay: each MCP server is granted once")
        cap = await self.core.open_relay(request.ticket_id, list(request.models), request.budget_tokens, mcp)
        return pb.OpenRelayResponse(capability=cap)

    async def RelayUsage(self, request: pb.RelayUsageRequest,
                         context: grpc.aio.ServicerContext) -> pb.RelayUsageResponse:
        usage, budget, is_open = self.core.relay_usage(request.ticket_id)
        calls, total = self.core.relay_mcp_calls(request.ticket_id, request.mcp_calls_from)
        return pb.RelayUsageResponse(
            models=[pb.ModelUsage(model=k, input_tokens=u.input_tokens, output_tokens=u.output_tokens,
                                  requests=u.requests, refused=u.refused) for k, u in sorted(usage.items())],
            total_tokens=sum(u.total for u in usage.values()), budget_tokens=budget, open=is_open,
            mcp_calls=[pb.RelayMcpCall(**{k: v for k, v in c.items() if k in MCP_CALL_FIELDS}) for c in calls],
            mcp_calls_total=total)

    async def CloseRelay(self, request: pb.CloseRelayRequest,
                         context: grpc.aio.ServicerContext) -> pb.CloseRelayResponse:
        await self.core.close_relay(request.ticket_id)
        return pb.CloseRelayResponse()


    async def GetRepoPermission(self, request: pb.GetRepoPermissionRequest,
                                context: grpc.aio.ServicerContext) -> pb.GetRepoPermissionResponse:
        permission = await self.core.repo_permission(request.workspace, request.username)
        return pb.GetRepoPermissionResponse(permission=permission,
                                            can_write=permission in ("admin", "maintain", "write"))

    async def ListRepoEvents(self, request: pb.ListRepoEventsRequest,
                             context: grpc.aio.ServicerContext) -> pb.ListRepoEventsResponse:
        r = await self.core.repo_events(request.workspace, request.etag, request.after_id)
        return pb.ListRepoEventsResponse(
            not_modified=r.not_modified, etag=r.etag, poll_interval_s=r.poll_interval_s,
            rate_limit_reset_ms=r.rate_limit_reset_ms, rate_limit_remaining=r.rate_limit_remaining,
            rate_limited=r.rate_limited, retry_after_s=r.retry_after_s, complete=r.complete,
            events=[pb.RepoEvent(id=e.id, type=e.type, actor_login=e.actor_login, payload_json=e.payload_json,
                                 repo=e.repo) for e in r.events])

    async def UpsertIssueComment(self, request: pb.UpsertIssueCommentRequest,
                                 context: grpc.aio.ServicerContext) -> pb.UpsertIssueCommentResponse:
        cid, url, created = await self.core.upsert_issue_comment(request.workspace, request.number,
                                                                 request.ticket_id, request.step, request.body,
                                                                 fence=request.fence)
        return pb.UpsertIssueCommentResponse(comment_id=cid, url=url, created=created)

    async def SetCommitStatus(self, request: pb.SetCommitStatusRequest,
                              context: grpc.aio.ServicerContext) -> pb.SetCommitStatusResponse:
        await self.core.set_commit_status(request.workspace, request.sha, request.state, request.context,
                                          request.description, request.target_url,
                                          ticket_id=request.ticket_id, fence=request.fence)
        return pb.SetCommitStatusResponse()

    async def PrepareVerification(self, request: pb.PrepareVerificationRequest,
                                  context: grpc.aio.ServicerContext) -> pb.PrepareVerificationResponse:
        v = await self.core.prepare_verification(request.ticket_id, request.workspace, request.sha,
                                                 list(request.base_paths), list(request.commands))
        return _prepared(v)

    def VerificationArchive(self, request: pb.PrepareVerificationRequest, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[pb.VerificationArchiveOutput]:
        return closed_with_call(context, self._verification_archive(request))   # closed when the call ends

    async def _verification_archive(self, request: pb.PrepareVerificationRequest
                                    ) -> AsyncGenerator[pb.VerificationArchiveOutput, None]:
        async with self.core.verification_archive(request.ticket_id, request.workspace, request.sha,
                                                  list(request.base_paths), list(request.commands)) as (v, chunks):
            yield pb.VerificationArchiveOutput(prepared=_prepared(v))
            async for data in chunks:
                yield pb.VerificationArchiveOutput(chunk=data)

    async def ReleaseVerification(self, request: pb.ReleaseWorkspaceRequest,
                                  context: grpc.aio.ServicerContext) -> pb.ReleaseWorkspaceResponse:
        await self.core.release_verification(request.ticket_id)
        return pb.ReleaseWorkspaceResponse()

    # -- the run record (R42, signing.py) ---------------------------------------
    async def SigningKey(self, request: pb.SigningKeyRequest,
                         context: grpc.aio.ServicerContext) -> pb.SigningKeyResponse:
        pem, keyid, raw = self.core.signing_key()
        return pb.SigningKeyResponse(public_key_pem=pem, public_key_raw_b64=base64.b64encode(raw).decode(),
                                     keyid=keyid)

    async def SignStatement(self, request: pb.SignStatementRequest,
                            context: grpc.aio.ServicerContext) -> pb.SignStatementResponse:
        return pb.SignStatementResponse(envelope=await self.core.sign_statement(request.ticket_id,
                                                                                request.statement))

    async def GetCheckDetails(self, request: pb.GetCheckDetailsRequest,
                              context: grpc.aio.ServicerContext) -> pb.GetCheckDetailsResponse:
        r = await self.core.check_details(request.workspace, request.sha, request.with_logs)
        return pb.GetCheckDetailsResponse(
            pending=r.pending, rate_limited=r.rate_limited, rate_limit_reset_ms=r.rate_limit_reset_ms,
            retry_after_s=r.retry_after_s,
            checks=[pb.CheckDetail(kind=c.kind, name=c.name, app=c.app, conclusion=c.conclusion, title=c.title,
                                   summary=c.summary, description=c.description, details_url=c.details_url,
                                   target_url=c.target_url, log_tail=c.log_tail, id=c.id) for c in r.checks])

    # -- MCP tools of model nodes (R43, mcptools/nodes.py) -----------------------------
    async def ListMcpTools(self, request: pb.ListMcpToolsRequest,
                           context: grpc.aio.ServicerContext) -> pb.ListMcpToolsResponse:
        r = await self.core.list_mcp_tools(request.ticket_id, request.workflow, request.node)
        return pb.ListMcpToolsResponse(
            tools=[pb.McpToolSpec(server=s, name=t.name, description=t.description,
                                  input_schema_json=t.input_schema_json) for s, t in r.tools],
            missing=[pb.McpToolRef(server=s, tool=t) for s, t in r.missing])

    async def CallMcpTool(self, request: pb.CallMcpToolRequest,
                          context: grpc.aio.ServicerContext) -> pb.CallMcpToolResponse:
        r = await self.core.call_mcp_tool(request.ticket_id, request.workflow, request.node, request.server,
                                          request.tool, request.arguments_json, fence=request.fence)
        return pb.CallMcpToolResponse(text=r.text, is_error=r.is_error, bytes=r.bytes, truncated=r.truncated)


async def _archive_input(request_iterator: AsyncIterator[_ArchiveInput[_Request_co]], rpc: str
                         ) -> tuple[_Request_co, AsyncIterator[bytes]]:
    """(the first message's request, the archive's chunks) of a CommitArchive-like stream."""
    it = request_iterator.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        raise InvalidArgument(f"{rpc} needs its request as the first message") from None
    if first.WhichOneof("input") != "request":
        raise InvalidArgument(f"the first {rpc} message must be `request`")

    async def chunks() -> AsyncIterator[bytes]:
        async for msg in it:
            if msg.WhichOneof("input") != "chunk":
                raise InvalidArgument(f"after `request`, {rpc} takes only `chunk` messages")
            yield msg.chunk

    return first.request, chunks()


def register(core: CredentialCore) -> Callable[[grpc.aio.Server], None]:
    servicer = CredentialBrokerServicer(core)
    return lambda server: pb_grpc.add_CredentialBrokerServicer_to_server(servicer, server)


def _prepared(v: verifycheckout.Verification) -> pb.PrepareVerificationResponse:
    return pb.PrepareVerificationResponse(sha=v.sha, base_sha=v.base_sha, tree=v.tree, commit=v.commit,
                                          workspace_ticket=v.workspace_ticket, harness_changes=v.harness_changes,
                                          binary_files=v.binary_files, shadowing=v.shadowing,
                                          conflicts=v.conflicts)
