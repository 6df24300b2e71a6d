"""The credential broker's calls of the clean-room verification (R41,
executor/nodes/verification.py), mixed into `CredentialsClient`
(brokers.py): the checkout of a head at <data>/workspaces/<ticket>-verify
and its removal. The id is `services.common.layout.verify_id`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from services._gen.afe.credentials.v1 import credentials_pb2 as cpb
from services.common.rpc.grpcutil import rpc_errors

from .archive import prepared_then_chunks

CREDENTIALS = "the credential broker"
LONG = 900.0     # a fetch of the mirror and a checkout


class VerificationCalls:
    stub: Any

    async def prepare_verification(self, ticket_id: str, workspace: str, sha: str, base_paths: list[str],
                                   commands: list[str]) -> cpb.PrepareVerificationResponse:
        async with rpc_errors(CREDENTIALS, "preparing the verification checkout"):
            r: cpb.PrepareVerificationResponse = await self.stub.PrepareVerification(
                cpb.PrepareVerificationRequest(ticket_id=ticket_id, workspace=workspace, sha=sha,
                                               base_paths=base_paths, commands=commands), timeout=LONG)
            return r

    @contextlib.asynccontextmanager
    async def verification_archive(self, ticket_id: str, workspace: str, sha: str, base_paths: list[str],
                                   commands: list[str]
                                   ) -> AsyncIterator[tuple[cpb.PrepareVerificationResponse, AsyncIterator[bytes]]]:
        """PrepareVerification whose checkout comes as tar chunks (VerificationArchive): for a
        sandbox broker on another host (sandboxes/remoteworkspace.py)."""
        call = self.stub.VerificationArchive(cpb.PrepareVerificationRequest(
            ticket_id=ticket_id, workspace=workspace, sha=sha, base_paths=base_paths, commands=commands),
            timeout=LONG)
        async with prepared_then_chunks(call, "preparing the verification checkout") as (prepared, chunks):
            yield prepared, chunks

    async def release_verification(self, ticket_id: str, workspace: str) -> None:
        async with rpc_errors(CREDENTIALS, "removing the verification checkout"):
            await self.stub.ReleaseVerification(cpb.ReleaseWorkspaceRequest(ticket_id=ticket_id,
                                                                            workspace=workspace), timeout=LONG)
