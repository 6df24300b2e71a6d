"""The credential broker's core: workspaces, forges and models by manifest
name. No grpc here; `servicer.py` maps requests and results.

The broker never takes a URL, token or key from a caller: a caller names a
Workspace or a Model, and everything else comes from the manifests and the
broker's own environment (R1, R14, R28).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from services.common.config.model import Config, Model, Workspace
from services.common.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from services.common.layout import check_ticket_id
from services.common.mcpclient import ToolResult
from services.common.secrecy.redact import Redactor
from services.credentials.fencing.resource import FenceGuard, Fences
from services.credentials.forges.base import MERGE_METHODS, Forge, PullRequestInfo
from services.credentials.forges.github import GitHubForge
from services.credentials.forges.github_checks import CheckDetails, ChecksReader
from services.credentials.forges.github_events import RepoEvents
from services.credentials.forges.reportmarks import STEP, load_key, mark
from services.credentials.mcptools.nodes import Listed, ModelNodeMcp
from services.credentials.records.signing import Signer
from services.credentials.relay.server import RelayHub, Usage
from services.credentials.relay.state import McpCall
from services.credentials.verification import checkout as verifycheckout
from services.credentials.workspaces import handover
from services.credentials.workspaces.host import Committed, Prepared, WorkspaceGit, branch_for

from .models.base import Completion, ModelProvider, Msg, Tool

log = logging.getLogger(__name__)

PERMISSION_TTL_S = 60.0        # how long a GitHub permission lookup is trusted
PERMISSION_CACHE_MAX = 4096
SHA = re.compile(r"^[0-9a-fA-F]{40}$")
STATUS_STATES = ("pending", "success", "failure", "error")
STATUS_CONTEXT = re.compile(r"^afe/[A-Za-z0-9._/-]{1,100}$")
GITHUB_LOGIN = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})(?:\[bot\])?$")


@dataclass(frozen=True)
class Approval:
    principal: str
    sha: str
    at_ms: int = 0


@dataclass(frozen=True)
class MergeOutcome:
    merged: bool
    merge_sha: str
    already_merged: bool


class CredentialCore:
    def __init__(self, config: Config, git: WorkspaceGit, forges: dict[str, Forge],
                 providers: dict[str, ModelProvider], redactor: Redactor, relay: RelayHub | None = None,
                 report_key_file: Path | None = None, fences: FenceGuard | None = None,
                 signer: Signer | None = None, mcp: ModelNodeMcp | None = None) -> None:
        self.config = config
        self.mcp = mcp                                # mcptools/nodes.py: model nodes' MCP tools (R43)
        self.signer = signer                          # signing.py: the run records' key (R42)
        # R37: the fence of each side effect; the highest per ticket in a file, or the database's (fencing/database.py)
        self.fences: FenceGuard = fences if fences is not None else Fences(None)
        self.relay = relay
        self.git = git
        self.forges = forges
        self.providers = providers
        self.redactor = redactor
        self._merge_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._permissions: dict[tuple[str, str], tuple[float, str]] = {}   # (ws, login) -> (until, permission)
        self.report_key_file = report_key_file        # reportmarks.py: the key of the comments' marks
        self._report_key_bytes: bytes | None = None
        self._report_locks: dict[tuple[str, str, str, str], asyncio.Lock] = {}

    # -- lookups -----------------------------------------------------------
    def workspace(self, name: str) -> Workspace:
        ws = self.config.workspaces.get(name)
        if ws is None:
            known = ", ".join(sorted(self.config.workspaces)) or "none"
            raise NotFound(f"unknown workspace {name!r}; the manifests define: {known}")
        return ws

    def model(self, name: str) -> Model:
        m = self.config.models.get(name)
        if m is None:
            known = ", ".join(sorted(self.config.models)) or "none"
            raise NotFound(f"unknown model {name!r}; the manifests define: {known}")
        return m

    def forge(self, ws: Workspace) -> Forge:
        forge = self.forges.get(ws.forge.type)
        if forge is None:
            raise InvalidArgument(f"workspace {ws.name!r}: forge type {ws.forge.type!r} is not supported "
                                  f"(use one of: {', '.join(sorted(self.forges))})")
        return forge

    # -- git ---------------------------------------------------------------
    async def prepare_workspace(self, ticket_id: str, workspace: str) -> Prepared:
        check_ticket_id(ticket_id)
        return await self.git.prepare(self.workspace(workspace), ticket_id)

    async def commit(self, ticket_id: str, workspace: str, message: str, fence: int = 0) -> Committed:
        check_ticket_id(ticket_id)
        ws = self.workspace(workspace)
        async with self.fences.hold(ticket_id, fence):
            return await self.git.commit(ws, ticket_id, message)

    async def checkpoint_workspace(self, ticket_id: str, workspace: str, node: str, fence: int = 0) -> str:
        """The workspace's state after `node` completed, kept for a new attempt (WorkspaceGit.checkpoint)."""
        check_ticket_id(ticket_id)
        ws = self.workspace(workspace)
        async with self.fences.hold(ticket_id, fence):
            return await self.git.checkpoint(ws, ticket_id, node)

    async def restore_workspace(self, ticket_id: str, workspace: str, node: str, fence: int = 0) -> str:
        """The workspace put back to its state after `node` (WorkspaceGit.restore)."""
        check_ticket_id(ticket_id)
        self.workspace(workspace)
        async with self.fences.hold(ticket_id, fence):
            return await self.git.restore(ticket_id, node)

    async def diff(self, ticket_id: str, workspace: str, max_bytes: int) -> tuple[str, bool]:
        check_ticket_id(ticket_id)
        self.workspace(workspace)
        return await self.git.diff(ticket_id, max_bytes)

    async def push(self, ticket_id: str, workspace: str, fence: int = 0) -> tuple[str, str]:
        check_ticket_id(ticket_id)
        ws = self.workspace(workspace)
        async with self.fences.hold(ticket_id, fence):
            return await self.git.push(ws, ticket_id)

    async def release_workspace(self, ticket_id: str, workspace: str) -> None:
        """The ticket has ended: its relay goes first (R32), then its git dir and workspace."""
        check_ticket_id(ticket_id)
        await self.close_relay(ticket_id)
        await self.git.release(ticket_id, self.config.workspaces.get(workspace))
        await verifycheckout.release(self.git, ticket_id)
        self.fences.forget(ticket_id)

    async def prepare_verification(self, ticket_id: str, workspace: str, sha: str, base_paths: list[str],
                                   commands: list[str] | None = None) -> verifycheckout.Verification:
        """The clean-room checkout of `sha` at <data>/workspaces/<ticket>-verify (R41, verification/checkout.py)."""
        check_ticket_id(ticket_id)
        return await verifycheckout.prepare(self.git, self.workspace(workspace), ticket_id, sha, base_paths,
                                            commands=commands)

    async def release_verification(self, ticket_id: str) -> None:
        await verifycheckout.release(self.git, check_ticket_id(ticket_id))

    @contextlib.asynccontextmanager
    async def verification_archive(self, ticket_id: str, workspace: str, sha: str, base_paths: list[str],
                                   commands: list[str] | None = None
                                   ) -> AsyncIterator[tuple[verifycheckout.Verification, AsyncIterator[bytes]]]:
        """PrepareVerification with the checkout as tar chunks, for a sandbox broker on another host."""
        check_ticket_id(ticket_id)
        ws = self.workspace(workspace)
        async with handover.private_folder(self.git.layout) as work:
            v = await verifycheckout.prepare(self.git, ws, ticket_id, sha, base_paths, into=work,
                                             commands=commands)
            yield v, (_nothing() if v.conflicts else handover.packed(work))

    # -- the workspace on another host (handover.py) --------------------------
    @contextlib.asynccontextmanager
    async def checkout_archive(self, ticket_id: str, workspace: str
                               ) -> AsyncIterator[tuple[Prepared, AsyncIterator[bytes]]]:
        """PrepareWorkspace with the checkout as tar chunks instead of a folder here."""
        check_ticket_id(ticket_id)
        ws = self.workspace(workspace)
        async with handover.private_folder(self.git.layout) as work:
            prepared = await self.git.prepare(ws, ticket_id, into=work)
            yield prepared, handover.packed(work)

    async def commit_archive(self, ticket_id: str, workspace: str, message: str,
                             chunks: AsyncIterator[bytes], fence: int = 0) -> Committed:
        check_ticket_id(ticket_id)
        ws = self.workspace(workspace)
        async with self.fences.hold(ticket_id, fence), handover.unpacked(self.git.layout, chunks) as work:
            return await self.git.commit(ws, ticket_id, message, work)

    async def diff_archive(self, ticket_id: str, workspace: str, max_bytes: int,
                           chunks: AsyncIterator[bytes]) -> tuple[str, bool]:
        check_ticket_id(ticket_id)
        self.workspace(workspace)
        async with handover.unpacked(self.git.layout, chunks) as work:
            return await self.git.diff(ticket_id, max_bytes, work)

    async def release_archive(self, ticket_id: str, workspace: str, chunks: AsyncIterator[bytes]) -> None:
        """ReleaseWorkspace keeping the last state the stream holds."""
        check_ticket_id(ticket_id)
        await self.close_relay(ticket_id)
        async with handover.unpacked(self.git.layout, chunks) as work:
            await self.git.release(ticket_id, self.config.workspaces.get(workspace), work)
        self.fences.forget(ticket_id)

    async def update_branch(self, ticket_id: str, workspace: str, fence: int = 0) -> tuple[str, bool, list[str]]:
        """Merge the base branch into the ticket's pushed branch on the host and
        push it: (new head, changed, conflicting paths)."""
        check_ticket_id(ticket_id)
        ws = self.workspace(workspace)
        async with self.fences.hold(ticket_id, fence):
            return await self.git.update_branch(ws, ticket_id)

    # -- forge -------------------------------------------------------------
    async def open_pull_request(self, ticket_id: str, workspace: str, title: str, body: str,
                                fence: int = 0) -> PullRequestInfo:
        check_ticket_id(ticket_id)
        ws = self.workspace(workspace)
        title = title.strip() or f"afe: ticket {ticket_id}"
        async with self.fences.hold(ticket_id, fence):
            return await self.forge(ws).open_pull_request(ws, branch_for(ticket_id), ws.base_branch, title, body)

    async def get_pull_request(self, workspace: str, number: str) -> PullRequestInfo:
        ws = self.workspace(workspace)
        return await self.forge(ws).get_pull_request(ws, _number(number))

    async def merge_pull_request(self, ticket_id: str, workspace: str, number: str,
                                 approval: Approval | None, method: str = "", fence: int = 0,
                                 expected_base_sha: str = "") -> MergeOutcome:
        """Merge only with a person's approval of exactly the current head (R16), and with
        `expected_base_sha` only onto that base tip, the one the head was verified on (R41)."""
        ws = self.workspace(workspace)
        number = _number(number)
        method = method or ws.forge.merge_method
        if method not in MERGE_METHODS:
            raise InvalidArgument(f"merge method {method!r} is not one of {', '.join(MERGE_METHODS)}")
        forge = self.forge(ws)
        if fence:
            check_ticket_id(ticket_id)
        lock = self._merge_locks.setdefault((ws.name, number), asyncio.Lock())
        async with self.fences.hold(ticket_id, fence), lock:
            pr = await forge.get_pull_request(ws, number)
            if pr.state == "merged":
                # A repeated call (the scheduler retries a merge after a crash, R37): success, no
                # second merge -- but only if what was merged is what the person approved.
                if approval is not None and approval.sha and pr.head_sha and approval.sha != pr.head_sha:
                    raise FailedPrecondition(
                        f"pull request {number} was already merged at {pr.head_sha[:12]}, not at the "
                        f"approved {approval.sha[:12]}; check the repository's history")
                return MergeOutcome(False, pr.merge_sha, True)
            if approval is None or not approval.principal or not approval.sha:
                raise PermissionDenied(f"pull request {number} has no approval record; a person must "
                                       "approve it before it is merged (R16)")
            if pr.state != "open":
                raise FailedPrecondition(f"pull request {number} is {pr.state}; it cannot be merged")
            if approval.sha != pr.head_sha:
                raise PermissionDenied(
                    f"pull request {number} changed after approval: approved {approval.sha[:12]}, "
                    f"head is now {pr.head_sha[:12]}; approve the new head before merging (R16)")
            if expected_base_sha:
                tip = await self.git.base_tip(ws)
                if tip != expected_base_sha:
                    raise Aborted(f"the base branch {ws.base_branch} moved to {tip[:12] or 'nothing'} since the "
                                  f"head was verified on {expected_base_sha[:12]}; it is verified again")
            merge_sha = await forge.merge_pull_request(ws, number, approval.sha, method,
                                                       base_sha=expected_base_sha)
            log.info("merged pull request %s of workspace %s (approved by %s) as %s",
                     number, ws.name, approval.principal, merge_sha[:12])
            return MergeOutcome(True, merge_sha, False)

    async def comment_pull_request(self, workspace: str, number: str, body: str, ticket_id: str = "",
                                   fence: int = 0) -> str:
        ws = self.workspace(workspace)
        if not body.strip():
            raise InvalidArgument("a comment needs a body")
        async with self.fences.hold(_fenced_ticket(ticket_id, fence), fence):
            return await self.forge(ws).comment(ws, _number(number), body)

    # -- GitHub intake (docs/GITHUB.md) ---------------------------------------
    def _github(self, workspace: str) -> tuple[Workspace, GitHubForge]:
        ws = self.workspace(workspace)
        forge = self.forges.get("github")
        if ws.forge.type != "github" or not isinstance(forge, GitHubForge):
            raise FailedPrecondition(f"workspace {workspace!r} has no github forge; set forge: {{type: github, "
                                     "repo: owner/name}} on the Workspace")
        return ws, forge

    async def repo_permission(self, workspace: str, username: str) -> str:
        """GitHub's permission of `username` on the workspace's repository, cached for
        PERMISSION_TTL_S (a revoked collaborator is refused again within that time)."""
        if not GITHUB_LOGIN.match(username or ""):
            raise InvalidArgument("username must be a GitHub login (letters, digits and -)")
        ws, forge = self._github(workspace)
        key = (workspace, username.lower())
        now = time.monotonic()
        hit = self._permissions.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        value = await forge.permission(ws, username)
        if len(self._permissions) >= PERMISSION_CACHE_MAX:
            self._permissions.clear()
        self._permissions[key] = (now + PERMISSION_TTL_S, value)
        return value

    async def repo_events(self, workspace: str, etag: str, after_id: str = "") -> RepoEvents:
        ws, forge = self._github(workspace)
        return await forge.repo_events(ws, etag, after_id)

    async def check_details(self, workspace: str, sha: str, with_logs: bool) -> CheckDetails:
        """The failing checks of commit `sha`, with their logs' redacted tails (github_checks.py)."""
        if not SHA.match(sha or ""):
            raise InvalidArgument("sha must be a full commit SHA (40 hex digits)")
        ws, forge = self._github(workspace)
        return await ChecksReader(forge, ws, self.redactor.redact).read(sha.lower(), with_logs)

    # -- reporting back (docs/GITHUB.md, "Reporting back") -----------------------
    async def upsert_issue_comment(self, workspace: str, number: str, ticket_id: str, step: str,
                                   body: str, fence: int = 0) -> tuple[str, str, bool]:
        """The one comment of (ticket, step) on the issue: edited when it exists, else posted (R37)."""
        check_ticket_id(ticket_id)
        if not STEP.match(step or ""):
            raise InvalidArgument("step must be 1-40 of a-z, 0-9, _ and -")
        if not body.strip():
            raise InvalidArgument("a comment needs a body")
        number = _number(number)
        ws, forge = self._github(workspace)
        the_mark = mark(self._report_key(), ws.forge.repo, number, ticket_id, step)
        if len(self._report_locks) > PERMISSION_CACHE_MAX:
            self._report_locks = {k: v for k, v in self._report_locks.items() if v.locked()}
        lock = self._report_locks.setdefault((ws.name, number, ticket_id, step), asyncio.Lock())
        async with self.fences.hold(ticket_id, fence), lock:
            return await forge.upsert_comment(ws, number, body, the_mark)

    async def set_commit_status(self, workspace: str, sha: str, state: str, context: str, description: str,
                                target_url: str, ticket_id: str = "", fence: int = 0) -> None:
        if not SHA.match(sha or ""):
            raise InvalidArgument("sha must be a full commit SHA (40 hex digits)")
        if state not in STATUS_STATES:
            raise InvalidArgument(f"state must be one of {', '.join(STATUS_STATES)}")
        if not STATUS_CONTEXT.match(context or ""):
            raise InvalidArgument("context must start with afe/ and hold only letters, digits, . _ - /")
        if target_url and not re.match(r"^https?://[^\s]+$", target_url):
            raise InvalidArgument("target_url must be an http:// or https:// URL")
        ws, forge = self._github(workspace)
        async with self.fences.hold(_fenced_ticket(ticket_id, fence), fence):
            await forge.set_status(ws, sha.lower(), state, context, description.replace("\n", " ")[:140],
                                   target_url[:2000])

    def _report_key(self) -> bytes:
        if self._report_key_bytes is None:
            if self.report_key_file is None:
                raise FailedPrecondition("this credential broker has no report key file")
            self._report_key_bytes = load_key(self.report_key_file)
        return self._report_key_bytes

    # -- models ------------------------------------------------------------
    async def complete(self, model: str, messages: list[Msg], tools: list[Tool], max_tokens: int) -> Completion:
        m = self.model(model)
        provider = self.providers.get(m.provider)
        if provider is None:
            raise InvalidArgument(f"model {m.name!r}: provider {m.provider!r} is not supported "
                                  f"(use one of: {', '.join(sorted(self.providers))})")
        if not messages:
            raise InvalidArgument("a completion needs at least one message")
        limit = min(max_tokens, m.max_tokens) if max_tokens > 0 else m.max_tokens
        return await provider.complete(m, messages, tools, limit)

    # -- model relay (R32) --------------------------------------------------------
    def _relay(self) -> RelayHub:
        if self.relay is None:
            raise FailedPrecondition("this credential broker has no model relay")
        return self.relay

    async def open_relay(self, ticket_id: str, models: list[str], budget_tokens: int,
                         mcp: dict[str, list[str]] | None = None) -> str:
        return await self._relay().open(ticket_id, models, budget_tokens, mcp)

    def relay_usage(self, ticket_id: str) -> tuple[dict[str, Usage], int, bool]:
        return self._relay().usage(ticket_id)

    def relay_mcp_calls(self, ticket_id: str, since: int) -> tuple[list[McpCall], int]:
        """The MCP calls the ticket's relay made (R43), numbered `since` and on, and the last number."""
        return self._relay().mcp_calls(ticket_id, since)

    async def close_relay(self, ticket_id: str) -> None:
        if self.relay is not None:
            await self.relay.close(ticket_id)

    # -- MCP tools of model nodes (R43, mcptools/nodes.py) ---------------------------
    def _mcp(self) -> ModelNodeMcp:
        if self.mcp is None:
            raise FailedPrecondition("this credential broker serves no MCP tools")
        return self.mcp

    async def list_mcp_tools(self, ticket_id: str, workflow: str, node: str) -> Listed:
        return await self._mcp().list_tools(ticket_id, workflow, node)

    async def call_mcp_tool(self, ticket_id: str, workflow: str, node: str, server: str, tool: str,
                            arguments_json: str, fence: int = 0) -> ToolResult:
        return await self._mcp().call_tool(ticket_id, workflow, node, server, tool, arguments_json, fence)

    # -- the run record (R42, signing.py) ------------------------------------
    def signing_key(self) -> tuple[str, str, bytes]:
        """(public key PEM, keyid, raw public key): never the private key."""
        if self.signer is None:
            raise FailedPrecondition("this credential broker has no signing key")
        k = self.signer.key
        return k.public_pem, k.keyid, k.raw_public

    async def sign_statement(self, ticket_id: str, statement: bytes) -> str:
        check_ticket_id(ticket_id)
        if self.signer is None:
            raise FailedPrecondition("this credential broker has no signing key")
        # the ticket's Workspace (its git dir names it): a head a person pushed is looked for on the remote
        ready = self.git.layout.gitdir(ticket_id) / "afe-ready"
        name = ready.read_text().strip() if ready.exists() else ""
        return await self.signer.sign(ticket_id, statement, self.config.workspaces.get(name))

    async def close(self) -> None:
        if self.relay is not None:
            await self.relay.aclose()
        await self.git.close()
        for f in self.forges.values():
            await f.close()
        for p in self.providers.values():
            await p.close()
        await self.fences.aclose()


def _fenced_ticket(ticket_id: str, fence: int) -> str:
    """The ticket of a fenced request that names it only for the fence."""
    if fence and not ticket_id:
        raise InvalidArgument("a request with a fence must name its ticket_id")
    return ticket_id


def _number(number: str) -> str:
    number = (number or "").strip()
    if not number.isdigit():
        raise InvalidArgument(f"pull request number must be digits, got {number!r}")
    return number


async def _nothing() -> AsyncIterator[bytes]:
    """No checkout to stream (the head does not merge onto the base)."""
    return
    yield b""
