"""The credential broker's calls of the clean-room verification (R41,
executor/nodes/verification.py), mixed into `CredentialsClient`
(brokers.py): the checkout of a head at <data>/workspaces/<ticket>-verify
and its removal."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from grpc.aio import EOF as grpc_eof

from services._gen.afe.credentials.v1 import credentials_pb2 as cpb
from services.common.errors import Unavailable
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

    @contextlib.asynccontextmanager
    async def verification_archive(self, ticket_id: str, workspace: str, sha: str, base_paths: list[str]
                                   ) -> AsyncIterator[tuple[cpb.PrepareVerificationResponse, AsyncIterator[bytes]]]:
        """PrepareVerification whose checkout comes as tar chunks (VerificationArchive): for a
        sandbox broker on another host (sandboxes/remoteworkspace.py)."""
        call = self.stub.VerificationArchive(cpb.PrepareVerificationRequest(
            ticket_id=ticket_id, workspace=workspace, sha=sha, base_paths=base_paths), timeout=LONG)
        try:
            async with rpc_errors(CREDENTIALS, "preparing the verification checkout"):
                first = await call.read()
            if first is grpc_eof or first.WhichOneof("output") != "prepared":
                raise Unavailable("the credential broker sent no verification checkout; retry")

            async def chunks() -> AsyncIterator[bytes]:
                async with rpc_errors(CREDENTIALS, "preparing the verification checkout"):
                    async for msg in call:
                        yield msg.chunk

            yield first.prepared, chunks()
        finally:
            call.cancel()

    async def release_verification(self, ticket_id: str, workspace: str) -> None:
        async with rpc_errors(CREDENTIALS, "removing the verification checkout"):
            await self.stub.ReleaseVerification(cpb.ReleaseWorkspaceRequest(ticket_id=ticket_id,
                                                                            workspace=workspace), timeout=LONG)


def verify_id(ticket_id: str) -> str:
    """The sandbox id (and workspace folder) of a ticket's verification: `<ticket>-verify`."""
    return ticket_id + VERIFY_SUFFIX


def verify_owner(sandbox_id: str) -> str:
    """The ticket whose verification sandbox `sandbox_id` is ("" for any other id)."""
    return sandbox_id[:-len(VERIFY_SUFFIX)] if sandbox_id.endswith(VERIFY_SUFFIX) else ""
