"""The scheduler, as the gateway sees it: calls over its gRPC Unix socket
with the gateway's link secret, results as /rpc JSON shapes, failures as
AfeErrors (never grpc exceptions)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from services._gen.afe.scheduler.v1 import hooks_pb2, hooks_pb2_grpc, scheduler_pb2_grpc
from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.rpc import grpcutil
from services.common.rpc.grpcutil import rpc_errors

from . import convert
from .convert import JsonObject

CALL_TIMEOUT = 30.0


class SchedulerBackend:
    def __init__(self, socket_path: Path, secret: bytes | None) -> None:
        self.socket_path = socket_path
        self.secret = secret
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerStub | None = None
        self._hooks: hooks_pb2_grpc.GitHubHooksStub | None = None
        self.origin = ""   # the gateway's public origin (build_app): local pull requests' URLs

    @property
    def stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        if self._stub is None:
            self._channel = grpcutil.open_channel(str(self.socket_path), self.secret)
            self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None
            self._hooks = None

    async def healthy(self) -> bool:
        return await grpcutil.check_health(str(self.socket_path), self.secret)

    async def create_ticket(self, *, workspace: str, workflow: str, title: str, body: str,
                            inputs: dict[str, str], principal: str) -> JsonObject:
        async with rpc_errors():
            t = await self.stub.CreateTicket(pb.CreateTicketRequest(
                workspace=workspace, workflow=workflow, title=title, body=body, inputs=inputs,
                principal=principal), timeout=CALL_TIMEOUT)
        return convert.ticket(t, self.origin)

    async def list_tickets(self, *, states: list[str], workspace: str, page_size: int,
                           page_token: str) -> JsonObject:
        req = pb.ListTicketsRequest(states=[convert.TICKET_STATE_BY_NAME[s] for s in states],
                                    workspace=workspace, page_size=page_size, page_token=page_token)
        async with rpc_errors():
            resp = await self.stub.ListTickets(req, timeout=CALL_TIMEOUT)
        return {"tickets": [convert.ticket(t, self.origin) for t in resp.tickets],
                "next_page_token": resp.next_page_token}

    async def get_ticket(self, ticket_id: str) -> JsonObject:
        async with rpc_errors():
            t = await self.stub.GetTicket(pb.GetTicketRequest(id=ticket_id), timeout=CALL_TIMEOUT)
        return convert.ticket(t, self.origin)

    async def get_pull(self, workspace: str, number: str) -> JsonObject:
        """The ticket of a pull request afe opened (the UI's pull-request page)."""
        async with rpc_errors():
            t = await self.stub.GetPullRequest(pb.GetPullRequestRequest(workspace=workspace, number=number),
                                               timeout=CALL_TIMEOUT)
        return convert.ticket(t, self.origin)

    async def signing_key(self) -> JsonObject:
        """The public key run records are signed with (R42)."""
        async with rpc_errors():
            k = await self.stub.GetSigningKey(pb.GetSigningKeyRequest(), timeout=CALL_TIMEOUT)
        return {"public_key_pem": k.public_key_pem, "keyid": k.keyid}

    async def run_records(self, ticket_id: str) -> JsonObject:
        """A ticket's signed run records (DSSE envelopes, R42) and its pull request's head."""
        async with rpc_errors():
            r = await self.stub.GetRunRecords(pb.GetTicketRequest(id=ticket_id), timeout=CALL_TIMEOUT)
        return {"ticket_id": r.ticket_id, "head_sha": r.head_sha, "forge_head_sha": r.forge_head_sha,
                "forge_error": r.forge_error,
                "records": [{"sha": x.sha, "kind": x.kind, "envelope": x.envelope, "at_ms": x.at_ms}
                            for x in r.records]}

    async def ticket_diff(self, ticket_id: str) -> JsonObject:
        async with rpc_errors():
            d = await self.stub.GetTicketDiff(pb.GetTicketRequest(id=ticket_id), timeout=CALL_TIMEOUT)
        return {"diff": d.diff, "truncated": d.truncated, "recorded": d.recorded}

    async def cancel_ticket(self, ticket_id: str, principal: str) -> JsonObject:
        async with rpc_errors():
            t = await self.stub.CancelTicket(pb.CancelTicketRequest(id=ticket_id, principal=principal),
                                             timeout=CALL_TIMEOUT)
        return convert.ticket(t, self.origin)

    async def approve_ticket(self, ticket_id: str, principal: str, sha: str,
                             accept_harness_change: bool = False) -> JsonObject:
        async with rpc_errors():
            t = await self.stub.ApproveTicket(
                pb.ApproveTicketRequest(id=ticket_id, principal=principal, sha=sha,
                                        accept_harness_change=accept_harness_change), timeout=CALL_TIMEOUT)
        return convert.ticket(t, self.origin)

    async def reject_ticket(self, ticket_id: str, principal: str, reason: str) -> JsonObject:
        async with rpc_errors():
            t = await self.stub.RejectTicket(
                pb.RejectTicketRequest(id=ticket_id, principal=principal, reason=reason),
                timeout=CALL_TIMEOUT)
        return convert.ticket(t, self.origin)

    async def followup_ticket(self, ticket_id: str, principal: str, instruction: str) -> JsonObject:
        async with rpc_errors():
            t = await self.stub.FollowUpTicket(
                pb.FollowUpTicketRequest(id=ticket_id, principal=principal, instruction=instruction),
                timeout=CALL_TIMEOUT)
        return convert.ticket(t, self.origin)

    async def retry_ticket(self, ticket_id: str, principal: str, from_node: str) -> JsonObject:
        async with rpc_errors():
            t = await self.stub.RetryTicket(
                pb.RetryTicketRequest(id=ticket_id, principal=principal, from_node=from_node), timeout=CALL_TIMEOUT)
        return convert.ticket(t, self.origin)

    async def update_ticket_branch(self, ticket_id: str, principal: str) -> JsonObject:
        async with rpc_errors():
            t = await self.stub.UpdateTicketBranch(
                pb.UpdateTicketBranchRequest(id=ticket_id, principal=principal), timeout=CALL_TIMEOUT)
        return convert.ticket(t, self.origin)

    async def watch_ticket(self, ticket_id: str, from_seq: int, follow: bool) -> AsyncIterator[JsonObject]:
        call = self.stub.WatchTicket(pb.WatchTicketRequest(id=ticket_id, from_seq=from_seq, follow=follow))
        try:
            async with rpc_errors():
                async for e in call:
                    yield convert.event(e)
        finally:
            call.cancel()

    async def list_workflows(self) -> JsonObject:
        async with rpc_errors():
            resp = await self.stub.ListWorkflows(pb.ListWorkflowsRequest(), timeout=CALL_TIMEOUT)
        return {"workflows": [convert.workflow(w) for w in resp.workflows]}

    async def list_workspaces(self) -> JsonObject:
        async with rpc_errors():
            resp = await self.stub.ListWorkspaces(pb.ListWorkspacesRequest(), timeout=CALL_TIMEOUT)
        return {"workspaces": [convert.workspace(w) for w in resp.workspaces]}

    async def deliver_github(self, delivery_id: str, event: str, payload: bytes) -> JsonObject:
        """A webhook delivery the gateway authenticated (gateway/hooks.py)."""
        if self._hooks is None:
            self.stub  # noqa: B018 - opens the channel
            self._hooks = hooks_pb2_grpc.GitHubHooksStub(self._channel)
        async with rpc_errors():
            r = await self._hooks.DeliverGitHubEvent(
                hooks_pb2.GitHubDelivery(delivery_id=delivery_id, event=event, payload=payload),
                timeout=CALL_TIMEOUT)
        return {"outcome": r.outcome, "reason": r.reason, "ticket_ids": list(r.ticket_ids)}
