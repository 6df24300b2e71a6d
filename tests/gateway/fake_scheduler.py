"""A small, real gRPC server speaking the Scheduler contract on a temp Unix
socket (with the real link-secret guard), for gateway tests that are about
auth and JSON-RPC plumbing rather than running tickets."""

from __future__ import annotations

import asyncio
import json
import time

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc
from services.common import errors
from services.common.rpc import grpcutil
from services.common.secrecy.redact import Redactor


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.tickets: dict[str, pb.Ticket] = {}
        self.events: dict[str, list[pb.Event]] = {}
        self.calls: list[tuple[str, object]] = []
        self._changed = asyncio.Event()
        self._n = 0
        self.records: dict[str, list[pb.RunRecord]] = {}     # GetRunRecords' answer per ticket
        self.diff_gate: asyncio.Event | None = None           # set: GetTicketDiff waits for it (a slow broker)
        self.diff_calls = 0
        self.workflows: list[pb.Workflow] | None = None      # ListWorkflows' answer (None: the demo's)

    def _event(self, tid: str, type_: str, payload: dict) -> None:
        evs = self.events.setdefault(tid, [])
        evs.append(pb.Event(ticket_id=tid, seq=len(evs) + 1, type=type_, payload_json=json.dumps(payload),
                            at_ms=int(time.time() * 1000)))
        self.tickets[tid].last_seq = len(evs)
        self._changed.set()
        self._changed = asyncio.Event()

    def _get(self, tid: str) -> pb.Ticket:
        if tid not in self.tickets:
            raise errors.NotFound(f"no ticket {tid!r}")
        return self.tickets[tid]

    async def CreateTicket(self, request, context):
        self.calls.append(("CreateTicket", request))
        if request.workflow != "demo-fix":
            raise errors.NotFound(f"no workflow {request.workflow!r}; known: demo-fix")
        self._n += 1
        tid = f"t{self._n}"
        t = pb.Ticket(id=tid, workspace=request.workspace or "demo", workflow=request.workflow,
                      title=request.title, body=request.body, inputs=dict(request.inputs), state=pb.TICKET_STATE_QUEUED,
                      nodes=[pb.NodeRun(id="fix", kind="model", state=pb.NODE_STATE_PENDING),
                             pb.NodeRun(id="merge", kind="builtin:merge", state=pb.NODE_STATE_PENDING, needs=["fix"])])
        self.tickets[tid] = t
        self._event(tid, "ticket.created", {"principal": request.principal})
        return t

    async def ListTickets(self, request, context):
        self.calls.append(("ListTickets", request))
        ts = [t for t in self.tickets.values() if not request.states or t.state in request.states]
        return pb.ListTicketsResponse(tickets=ts)

    async def GetTicket(self, request, context):
        return self._get(request.id)

    async def GetPullRequest(self, request, context):
        for t in self.tickets.values():
            if t.workspace == request.workspace and t.HasField("pr") and t.pr.number == request.number:
                return t
        raise errors.NotFound(f"workspace {request.workspace!r} has no pull request {request.number!r} that afe "
                              "opened")

    async def GetTicketDiff(self, request, context):
        self._get(request.id)
        self.diff_calls += 1
        if self.diff_gate is not None:
            await self.diff_gate.wait()
        return pb.TicketDiff(diff="--- a/calc.py\n+++ b/calc.py\n-    return a - b\n+    return a + b\n",
                             truncated=False)

    async def GetRunRecords(self, request, context):
        t = self._get(request.id)
        return pb.RunRecords(ticket_id=t.id, head_sha=t.pr.head_sha if t.HasField("pr") else "",
                             records=self.records.get(t.id, []))

    async def FollowUpTicket(self, request, context):
        self.calls.append(("FollowUpTicket", request))
        t = self._get(request.id)
        if t.state != pb.TICKET_STATE_WAITING_APPROVAL:
            raise errors.FailedPrecondition("the ticket is not waiting for approval")
        t.state = pb.TICKET_STATE_RUNNING
        t.awaiting_sha = ""
        self._event(t.id, "ticket.reopened", {"principal": request.principal, "reason": "follow-up"})
        return t

    async def CancelTicket(self, request, context):
        self.calls.append(("CancelTicket", request))
        t = self._get(request.id)
        t.state = pb.TICKET_STATE_CANCELLED
        self._event(t.id, "ticket.finished", {"state": "cancelled", "principal": request.principal})
        return t

    async def ApproveTicket(self, request, context):
        self.calls.append(("ApproveTicket", request))
        t = self._get(request.id)
        if t.state != pb.TICKET_STATE_WAITING_APPROVAL:
            raise errors.FailedPrecondition("the ticket is not waiting for approval")
        t.approval.CopyFrom(pb.Approval(principal=request.principal, sha=request.sha, granted=True))
        t.state = pb.TICKET_STATE_SUCCEEDED
        self._event(t.id, "approval.granted", {"principal": request.principal})
        return t

    async def RejectTicket(self, request, context):
        self.calls.append(("RejectTicket", request))
        t = self._get(request.id)
        t.approval.CopyFrom(pb.Approval(principal=request.principal, granted=False, reason=request.reason))
        t.state = pb.TICKET_STATE_FAILED
        self._event(t.id, "ticket.finished", {"state": "failed"})
        return t

    async def WatchTicket(self, request, context):
        self._get(request.id)
        seq = max(request.from_seq, 1)
        while True:
            evs = self.events.get(request.id, [])
            waiter = self._changed
            while seq <= len(evs):
                yield evs[seq - 1]
                seq += 1
            t = self.tickets[request.id]
            if not request.follow or t.state in (pb.TICKET_STATE_SUCCEEDED, pb.TICKET_STATE_FAILED, pb.TICKET_STATE_CANCELLED):
                return
            await waiter.wait()

    async def ListWorkflows(self, request, context):
        if self.workflows is not None:
            return pb.ListWorkflowsResponse(workflows=self.workflows)
        return pb.ListWorkflowsResponse(workflows=[pb.Workflow(
            name="demo-fix", workspace="demo",
            inputs=[pb.WorkflowInput(name="issue", required=True),
                    pb.WorkflowInput(name="level", default_value="high")],
            nodes=[pb.WorkflowNode(id="fix", kind="model"), pb.WorkflowNode(id="merge", kind="builtin:merge",
                                                                           needs=["fix"])])])

    async def ListWorkspaces(self, request, context):
        return pb.ListWorkspacesResponse(workspaces=[
            pb.Workspace(name="demo", repo="repos/calc.git", base_branch="main", forge="local"),
            pb.Workspace(name="gh", repo="https://git.example.org/mirror.git", base_branch="main", forge="github",
                         forge_repo="Octo/Calc")])

    # test helpers
    def set_state(self, tid: str, state: int) -> None:
        self.tickets[tid].state = state
        self._event(tid, "ticket.state", {"state": state})


async def start_fake_scheduler(socket_path: str, gateway_secret: bytes):
    fake = FakeScheduler()
    server = grpcutil.create_server(
        socket_path, {"gateway": gateway_secret}, Redactor(),
        [lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, s)])
    await server.start()
    return fake, server
