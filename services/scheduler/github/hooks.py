"""The thin gRPC layer of afe.scheduler.v1.GitHubHooks: the gateway hands
over a webhook delivery it has authenticated (R35); github_intake.py does
the rest. Only the gateway's link may call it (services/common/rpc/callers.py):
the automation key, which the scheduler also serves, gets PERMISSION_DENIED
(a local script files tickets through the Scheduler API, under its own name,
not as GitHub)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from services._gen.afe.scheduler.v1 import hooks_pb2 as pb
from services._gen.afe.scheduler.v1 import hooks_pb2_grpc as pb_grpc

from .intake import GitHubIntake

SERVICE = pb.DESCRIPTOR.services_by_name["GitHubHooks"].full_name


class GitHubHooksServicer(pb_grpc.GitHubHooksServicer):
    def __init__(self, intake: GitHubIntake) -> None:
        self.intake = intake

    async def DeliverGitHubEvent(self, request: pb.GitHubDelivery,
                                 context: grpc.aio.ServicerContext) -> pb.GitHubDeliveryResult:
        o = await self.intake.deliver(request.delivery_id, request.event, request.payload)
        return pb.GitHubDeliveryResult(outcome=o.outcome, reason=o.reason, ticket_ids=o.ticket_ids)


def register(intake: GitHubIntake) -> Callable[[Any], None]:
    servicer = GitHubHooksServicer(intake)
    return lambda server: pb_grpc.add_GitHubHooksServicer_to_server(servicer, server)
