"""The thin gRPC layer: parse the request, call the engine, map the result.
The boundary (caller table, ticket-id logging, text decoding, error
statuses) is grpcutil.create_server's, the same for every afe service.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from services.common.errors import InvalidArgument
from services.common.rpc import grpcutil
from services.common.states import NodeState, TicketState

from .engine.core import Engine
from .engine.followups import follow_up
from .engine.view import TicketView
from .store.base import EventRecord

# A watch whose caller takes in nothing for this long (the transport's window to it stays full) is
# dropped with RESOURCE_EXHAUSTED; the caller resumes with from_seq, so nothing is lost, and a stalled
# reader holds nothing in the scheduler beyond what the transport already holds for it.
WATCH_SEND_TIMEOUT_S = 30.0
RESUME_HINT = "watch again with from_seq = the seq after the last event you received"


def _ticket_state(word: str) -> pb.TicketState.ValueType:
    try:
        return TicketState(word).proto
    except ValueError:
        return pb.TICKET_STATE_UNSPECIFIED


def _node_state(word: str) -> pb.NodeState.ValueType:
    try:
        return NodeState(word).proto
    except ValueError:
        return pb.NODE_STATE_UNSPECIFIED


def ticket_pb(v: TicketView, sandbox_runtime: str = "") -> pb.Ticket:
    t = v.ticket
    msg = pb.Ticket(
        id=t.id, workspace=t.workspace, workflow=t.workflow, title=t.title, body=t.body, inputs=t.inputs,
        state=_ticket_state(t.state), created_at_ms=t.created_at_ms,
        updated_at_ms=t.updated_at_ms, error=t.error, last_seq=v.last_seq, awaiting_sha=t.awaiting_sha,
        tokens_used=t.tokens_used, sandbox_runtime=sandbox_runtime)
    for n in v.nodes:
        msg.nodes.append(pb.NodeRun(id=n.node_id, kind=n.kind, state=_node_state(n.state),
                                    needs=list(n.needs), attempt=n.attempt, started_at_ms=n.started_at_ms,
                                    finished_at_ms=n.finished_at_ms, output=n.output, error=n.error,
                                    rounds=n.rounds, feedback=n.feedback))
    if v.pr is not None:
        p = v.pr
        msg.pr.CopyFrom(pb.PullRequest(number=p.number, url=p.url, head_branch=p.head_branch,
                                       base_branch=p.base_branch, head_sha=p.head_sha, state=p.state,
                                       merge_sha=p.merge_sha))
    if t.origin:
        o = t.origin
        msg.origin.CopyFrom(pb.TicketOrigin(
            source=str(o.get("source", "")), event=str(o.get("event", "")),
            delivery_id=str(o.get("delivery_id", "")), url=str(o.get("url", "")), author=str(o.get("author", "")),
            trigger=str(o.get("trigger", "")), title_untrusted=bool(o.get("title_untrusted")),
            body_untrusted=bool(o.get("body_untrusted")),
            inputs=[pb.InputProvenance(name=str(i.get("name", "")), source=str(i.get("source", "")),
                                       untrusted=bool(i.get("untrusted"))) for i in o.get("inputs", ())]))
    if v.approval is not None:
        a = v.approval
        msg.approval.CopyFrom(pb.Approval(principal=a.principal, sha=a.sha, granted=a.granted, at_ms=a.at_ms,
                                          reason=a.reason))
    return msg


def event_pb(e: EventRecord) -> pb.Event:
    return pb.Event(ticket_id=e.ticket_id, seq=e.seq, type=e.type, payload_json=e.payload_json, at_ms=e.at_ms)


class SchedulerServicer(pb_grpc.SchedulerServicer):
    def __init__(self, engine: Engine, watch_send_timeout: float = WATCH_SEND_TIMEOUT_S) -> None:
        self.engine = engine
        self.watch_send_timeout = watch_send_timeout

    def _pb(self, v: TicketView) -> pb.Ticket:
        ws = self.engine.config.workspaces.get(v.ticket.workspace)
        return ticket_pb(v, ws.sandbox.runtime if ws is not None else "")

    async def CreateTicket(self, request: pb.CreateTicketRequest,
                           context: grpc.aio.ServicerContext) -> pb.Ticket:
        v = self.engine.create_ticket(request.workspace, request.workflow, request.title, request.body,
                                      dict(request.inputs), request.principal)
        return self._pb(v)

    async def ListTickets(self, request: pb.ListTicketsRequest,
                          context: grpc.aio.ServicerContext) -> pb.ListTicketsResponse:
        states = []
        for s in request.states:
            state = TicketState.from_proto(s)
            if state is None:
                raise InvalidArgument(f"unknown ticket state {s}; use one of "
                                      + ", ".join(f"TICKET_STATE_{t.name}" for t in TicketState))
            states.append(state.value)
        views, token = self.engine.list_tickets(states, request.workspace, request.page_size, request.page_token)
        return pb.ListTicketsResponse(tickets=[self._pb(v) for v in views], next_page_token=token)

    async def GetTicket(self, request: pb.GetTicketRequest, context: grpc.aio.ServicerContext) -> pb.Ticket:
        return self._pb(self.engine.view(request.id))

    async def GetPullRequest(self, request: pb.GetPullRequestRequest,
                             context: grpc.aio.ServicerContext) -> pb.Ticket:
        return self._pb(self.engine.pull_request(request.workspace, request.number))

    async def CancelTicket(self, request: pb.CancelTicketRequest,
                           context: grpc.aio.ServicerContext) -> pb.Ticket:
        return self._pb(await self.engine.cancel(request.id, request.principal))

    async def ApproveTicket(self, request: pb.ApproveTicketRequest,
                            context: grpc.aio.ServicerContext) -> pb.Ticket:
        return self._pb(await self.engine.approve(request.id, request.principal, request.sha,
                                                      accept_harness_change=request.accept_harness_change))

    async def RejectTicket(self, request: pb.RejectTicketRequest,
                           context: grpc.aio.ServicerContext) -> pb.Ticket:
        return self._pb(await self.engine.reject(request.id, request.principal, request.reason))

    async def WatchTicket(self, request: pb.WatchTicketRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Event]:
        # aclosing: a dropped watch (send_within raises) leaves the engine's watcher set at once.
        async with contextlib.aclosing(self.engine.watch(request.id, request.from_seq, request.follow)) as events:
            async for ev in events:
                await grpcutil.send_within(context, event_pb(ev), self.watch_send_timeout, RESUME_HINT)
        if False:  # an async generator (what the interceptors wrap); events go out through send_within
            yield

    async def GetSigningKey(self, request: pb.GetSigningKeyRequest,
                            context: grpc.aio.ServicerContext) -> pb.SigningKey:
        k = await self.engine.credentials.signing_key()
        return pb.SigningKey(public_key_pem=k.public_key_pem, keyid=k.keyid)

    async def GetRunRecords(self, request: pb.GetTicketRequest,
                            context: grpc.aio.ServicerContext) -> pb.RunRecords:
        t = self.engine.view(request.id).ticket           # NotFound for an unknown ticket
        pr = self.engine.store.prs.get_pr(t.id)
        forge_head, forge_error = await self.engine.forge_head(t.id)
        return pb.RunRecords(ticket_id=t.id, head_sha=pr.head_sha if pr else "", forge_head_sha=forge_head,
                             forge_error=forge_error, records=[
                                 pb.RunRecord(sha=r.sha, kind=r.kind, envelope=r.envelope, at_ms=r.at_ms)
                                 for r in self.engine.store.run_records.run_records(t.id)])

    async def GetTicketDiff(self, request: pb.GetTicketRequest,
                            context: grpc.aio.ServicerContext) -> pb.TicketDiff:
        diff, truncated, recorded = await self.engine.diff(request.id)
        return pb.TicketDiff(diff=diff, truncated=truncated, recorded=recorded)

    async def FollowUpTicket(self, request: pb.FollowUpTicketRequest,
                             context: grpc.aio.ServicerContext) -> pb.Ticket:
        view = await follow_up(self.engine, request.id, request.instruction, principal=request.principal)
        return self._pb(view)

    async def RetryTicket(self, request: pb.RetryTicketRequest,
                          context: grpc.aio.ServicerContext) -> pb.Ticket:
        return self._pb(await self.engine.retry(request.id, request.from_node, request.principal))

    async def UpdateTicketBranch(self, request: pb.UpdateTicketBranchRequest,
                                 context: grpc.aio.ServicerContext) -> pb.Ticket:
        return self._pb(await self.engine.update_branch(request.id, request.principal))

    async def ListWorkflows(self, request: pb.ListWorkflowsRequest,
                            context: grpc.aio.ServicerContext) -> pb.ListWorkflowsResponse:
        out = []
        for wf in sorted(self.engine.config.workflows.values(), key=lambda w: w.name):
            defaults = dict(wf.input_defaults)
            out.append(pb.Workflow(name=wf.name, workspace=wf.workspace or "", nodes=[
                pb.WorkflowNode(id=n.id, kind=n.label, needs=list(n.needs)) for n in wf.nodes],
                inputs=[pb.WorkflowInput(name=i, required=i not in defaults, default_value=defaults.get(i, ""))
                        for i in wf.inputs]))
        return pb.ListWorkflowsResponse(workflows=out)

    async def ListWorkspaces(self, request: pb.ListWorkspacesRequest,
                             context: grpc.aio.ServicerContext) -> pb.ListWorkspacesResponse:
        out = []
        for ws in sorted(self.engine.config.workspaces.values(), key=lambda w: w.name):
            out.append(pb.Workspace(name=ws.name, repo=ws.repo, base_branch=ws.base_branch, forge=ws.forge.type,
                                    egress=list(ws.sandbox.egress),
                                    forge_repo=ws.forge.repo if ws.forge.type == "github" else ""))
        return pb.ListWorkspacesResponse(workspaces=out)


def register(servicer: SchedulerServicer) -> Callable[[Any], None]:
    """A `register` callable for grpcutil.create_server."""
    return lambda server: pb_grpc.add_SchedulerServicer_to_server(servicer, server)
