"""The credential broker's calls of the clean-room verification (R41,
executor/nodes/verification.py), mixed into `CredentialsClient`
(brokers.py): the checkout of a head at <data>/workspaces/<ticket>-verify
and its removal."""

from __future__ import annotations

from typing import Any

from services._gen.afe.credentials.v1 import credentials_pb2 as cpb
from services.common.grpcutil import rpc_errors

CREDENTIALS = "the credential broker"
VERIFY_SUFFIX = "-verify"
LONG = 900.0     # a fetch of the mirror and a checkout


class VerificationCalls:
    stub: Any

    async def prepare_verification(self, ticket_id: str, workspace: str, sha: str,
                                   base_paths: list[str]) -> cpb.PrepareVerificationResponse:
        async with rpc_errors(CREDENTIALS, "preparing the verification checkout"):
            r: cpb.PrepareVerificationResponse = await self.stub.PrepareVerification(
                cpb.PrepareVerificationRequest(ticket_id=ticket_id, workspace=workspace, sha=sha,
                                               base_paths=base_paths), timeout=LONG)
            return r

    async def release_verification(self, ticket_id: str, workspace: str) -> None:
        async with rpc_errors(CREDENTIALS, "removing the verification checkout"):
            await self.stub.ReleaseVerification(cpb.ReleaseWorkspaceRequest(ticket_id=ticket_id,
                                                                            workspace=workspace), timeout=LONG)


def verify_id(ticket_id: str) -> str:
    """The sandbox id (and workspace folder) of a ticket's verification: `<ticket>-verify`."""
    return ticket_id + VERIFY_SUFFIX
