"""The workspace of a sandbox on another host (docs/SCALE.md).

With `--sandbox-broker`, a ticket's sandbox, and so its workspace folder,
is on a host whose folders the credential broker cannot read. This
`CredentialBroker` stands in for `CredentialsClient` and carries the
workspace through the contracts, as a tar stream the scheduler only relays
(services/common/safefs/archive.py):

- prepare: the ticket is placed now (`BrokerSet.place`), the credential
  broker prepares it with the checkout as an archive (CheckoutArchive) and
  the scheduler pipes it into the broker's WriteWorkspace, which unpacks it
  safely into the empty workspace within the disk cap;
- commit, diff, release: the broker's ReadWorkspace (a no-follow, bounded
  walk) piped into CommitArchive / DiffArchive / ReleaseArchive, which the
  credential broker runs on a private unpacked copy.

No token is in either stream (the checkout is made before the sandbox
exists; the credential broker pushes from its own git dir, R1-R3/R13).
Every other call goes to the credential broker unchanged. A ticket not
placed on any broker (its sandbox was never made) is released, diffed or
committed as before, where the credential broker reports what is missing.
Without `--sandbox-broker` this class is not used: the one-host path reads
the shared folder as before.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from services._gen.afe.credentials.v1 import credentials_pb2 as cpb
from services.common.config.model import Config
from services.common.errors import AfeError, FailedPrecondition
from services.common.layout import verify_id

from .brokers import CredentialsClient, SandboxClient
from .placement import BrokerSet

log = logging.getLogger(__name__)


class _Relay:
    """The chunks of one stream, relayed to another call; an error of the
    source is kept (the receiver then sees a cut archive and refuses it) and
    raised after the call, so the user reads the source's reason."""

    def __init__(self, source: AsyncIterator[bytes]) -> None:
        self.source = source
        self.error: AfeError | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for c in self.source:
                yield c
        except AfeError as exc:
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise self.error


class RemoteWorkspaces:
    """A `CredentialBroker` for tickets whose sandboxes are on other hosts."""

    def __init__(self, credentials: CredentialsClient, brokers: BrokerSet, config: Config) -> None:
        self.credentials = credentials
        self.brokers = brokers
        self.config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self.credentials, name)   # every call without a workspace folder: unchanged

    def _holder(self, ticket_id: str) -> SandboxClient | None:
        return self.brokers.holder(ticket_id) if self.brokers.placed_on(ticket_id) is not None else None

    def _disk(self, workspace: str) -> int:
        ws = self.config.workspaces.get(workspace)
        return ws.sandbox.limits.disk_bytes if ws is not None else 0

    async def prepare_verification(self, ticket_id: str, workspace: str, sha: str, base_paths: list[str],
                                   commands: list[str]) -> cpb.PrepareVerificationResponse:
        """The clean-room checkout (R41) for `<ticket>-verify`, placed now on a broker: made
        in the credential broker as an archive (VerificationArchive) and written into that
        broker's empty workspace (WriteWorkspace); DestroySandbox removes it there."""
        vid = verify_id(ticket_id)
        holder = await self.brokers.place(vid)
        async with self.credentials.verification_archive(ticket_id, workspace, sha, base_paths,
                                                         commands) as (v, chunks):
            if v.conflicts:     # the head does not merge onto the base: nothing to hand over
                return v
            relay = _Relay(chunks)
            try:
                r = await holder.write_workspace(vid, self._disk(workspace), relay.chunks())
            except AfeError:
                relay.check()
                raise
            relay.check()
        if r.existing:      # verification.py destroys any leftover first: a stale checkout is never verified
            raise FailedPrecondition(f"the sandbox broker {holder.peer} already held a workspace for {vid}; "
                                     "it was removed before: retry the ticket")
        log.info("ticket %s: verification checkout handed to %s (%d entries, %d bytes)", ticket_id, holder.peer,
                 r.entries, r.bytes)
        return v

    async def prepare(self, ticket_id: str, workspace: str) -> cpb.PrepareWorkspaceResponse:
        holder = await self.brokers.place(ticket_id)
        async with self.credentials.checkout_archive(ticket_id, workspace) as (prepared, chunks):
            relay = _Relay(chunks)
            try:
                r = await holder.write_workspace(ticket_id, self._disk(workspace), relay.chunks())
            except AfeError:
                relay.check()
                raise
            relay.check()
        log.info("ticket %s: workspace handed to %s (%d entries, %d bytes%s)", ticket_id, holder.peer,
                 r.entries, r.bytes, ", it already had one" if r.existing else "")
        return prepared

    async def _from_broker(self, holder: SandboxClient, ticket_id: str, rpc: str, what: str, first: Any,
                           fence: int = 0) -> Any:
        relay = _Relay(holder.read_workspace(ticket_id))
        try:
            r = await self.credentials.archive_call(rpc, what, first, relay.chunks(), fence)
        except AfeError:
            relay.check()
            raise
        relay.check()
        return r

    async def commit(self, ticket_id: str, workspace: str, message: str, fence: int = 0) -> cpb.CommitResponse:
        holder = self._holder(ticket_id)
        if holder is None:
            return await self.credentials.commit(ticket_id, workspace, message, fence)
        # CommitArchive answers what Commit does (the generated stub says so; archive_call is untyped)
        reply: cpb.CommitResponse = await self._from_broker(
            holder, ticket_id, "CommitArchive", "commit",
            cpb.CommitRequest(ticket_id=ticket_id, workspace=workspace, message=message, fence=fence), fence)
        return reply

    async def diff(self, ticket_id: str, workspace: str, max_bytes: int) -> cpb.DiffResponse:
        holder = self._holder(ticket_id)
        if holder is None:
            return await self.credentials.diff(ticket_id, workspace, max_bytes)
        reply: cpb.DiffResponse = await self._from_broker(
            holder, ticket_id, "DiffArchive", "the diff",
            cpb.DiffRequest(ticket_id=ticket_id, workspace=workspace, max_bytes=max_bytes))
        return reply

    async def checkpoint(self, ticket_id: str, workspace: str, node: str,
                         fence: int = 0) -> cpb.CheckpointWorkspaceResponse:
        """Not kept for a workspace on another host (the credential broker cannot read it): a
        takeover's re-run there continues from the files as they are."""
        if self._holder(ticket_id) is None:
            return await self.credentials.checkpoint(ticket_id, workspace, node, fence)
        raise FailedPrecondition(f"ticket {ticket_id}: its workspace is on another host, where no checkpoint "
                                 "is kept")

    async def restore(self, ticket_id: str, workspace: str, node: str,
                      fence: int = 0) -> cpb.CheckpointWorkspaceResponse:
        if self._holder(ticket_id) is None:
            return await self.credentials.restore(ticket_id, workspace, node, fence)
        raise FailedPrecondition(f"ticket {ticket_id}: its workspace is on another host, where no checkpoint "
                                 "is kept; it is left as it is")

    async def release(self, ticket_id: str, workspace: str) -> None:
        """Keep the workspace's last state (read from its broker), then release.
        A workspace its broker no longer has is released without keeping;
        a broker that does not answer fails the release (the teardown is retried)."""
        holder = self._holder(ticket_id)
        if holder is not None:
            try:
                await self._from_broker(holder, ticket_id, "ReleaseArchive", "releasing the workspace",
                                        cpb.ReleaseWorkspaceRequest(ticket_id=ticket_id, workspace=workspace))
                return
            except FailedPrecondition as exc:
                log.warning("ticket %s: its workspace on %s could not be read (%s); released without keeping it",
                            ticket_id, holder.peer, exc)
        await self.credentials.release(ticket_id, workspace)
