"""In-process fakes of the two broker clients, for the executor's fast tier.

They implement `SandboxBroker` and `CredentialBroker` (services/scheduler/
brokers.py), the same Protocols as the real gRPC clients; the Docker tests
(tests/scheduler/test_*.py) keep covering the real brokers.

A `run` node's command is a tiny script for `FakeSandbox.exec`, statements
separated by `;`:
    echo TEXT       TEXT and a newline on stdout
    exit N          end with exit code N
    sleep S         wait S seconds
    wait NAME       wait until gate NAME is opened (by `open NAME` or `FakeSandbox.open`)
    open NAME       open gate NAME
    once NAME       the first time this statement runs: "first" on stdout, exit 3
    hang            wait for ever (until cancelled)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services._gen.afe.credentials.v1 import credentials_pb2 as cpb
from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.common.errors import Aborted, NotFound, PeerUnavailable
from services.common.provenance import attestation
from services.scheduler.sandboxes.brokers import CredentialBroker, SandboxBroker


class FakeSandbox:
    stub = None   # no ACP process streams: agent nodes are tested against the real broker

    def stub_for(self, ticket_id: str) -> None:
        return self.stub

    def __init__(self) -> None:
        self.created: list[str] = []
        self.destroyed: list[str] = []
        self.started: list[tuple[str, str]] = []    # (ticket, command) in the order commands started
        self.ended: list[tuple[str, str, str]] = []  # (ticket, command, "exit N" | "cancelled")
        self.gates: dict[str, asyncio.Event] = {}
        self.onces: set[str] = set()
        self.denied: dict[str, list[tuple[str, int]]] = {}   # ticket -> hosts its proxy refused (DeniedEgress)
        self.allowed: dict[str, list[tuple[str, int]]] = {}  # ticket -> hosts its proxy let through
        self.requests: dict[str, list[spb.EgressRequest]] = {}  # ticket -> every request its proxy logged (R44)

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    def open(self, name: str) -> None:
        self.gate(name).set()

    @contextlib.asynccontextmanager
    async def creates_held(self) -> AsyncIterator[None]:
        yield

    async def create(self, ticket_id: str, spec: spb.SandboxSpec) -> spb.Sandbox:
        self.created.append(ticket_id)
        return spb.Sandbox(ticket_id=ticket_id, image=spec.image, state="running")

    async def destroy(self, ticket_id: str) -> int:
        self.destroyed.append(ticket_id)
        return 1

    async def reconcile(self, live: list[str]) -> spb.ReconcileResponse:
        return spb.ReconcileResponse(boot_id="fake")

    async def identify(self) -> str:
        return "fake"

    async def freeze(self, ticket_id: str, frozen: bool) -> None:
        return None

    async def denied_egress(self, ticket_id: str) -> spb.DeniedEgressResponse:
        if ticket_id not in self.created:
            raise NotFound(f"no sandbox for ticket {ticket_id}: create it first")
        return spb.DeniedEgressResponse(hosts=[spb.DeniedHost(host=h, count=n)
                                               for h, n in self.denied.get(ticket_id, [])],
                                        allowed=[spb.DeniedHost(host=h, count=n)
                                                 for h, n in self.allowed.get(ticket_id, [])],
                                        requests=self.requests.get(ticket_id, []))

    async def exec(self, ticket_id: str, argv: list[str], timeout_ms: int = 0, output_cap_bytes: int = 0,
                   cwd: str = "") -> AsyncIterator[spb.ExecEvent]:
        command = argv[2] if argv[:2] == ["bash", "-c"] else argv[-1]   # bash -c SCRIPT afe ARG...
        self.started.append((ticket_id, command))
        code = 0
        try:
            for statement in (s.strip() for s in command.split(";")):
                word, _, arg = statement.partition(" ")
                if word == "echo":
                    yield spb.ExecEvent(stdout=(arg + "\n").encode())
                elif word == "exit":
                    code = int(arg)
                    break
                elif word == "sleep":
                    await asyncio.sleep(float(arg))
                elif word == "wait":
                    await self.gate(arg).wait()
                elif word == "open":
                    self.open(arg)
                elif word == "once" and arg not in self.onces:
                    self.onces.add(arg)
                    yield spb.ExecEvent(stdout=b"first\n")
                    code = 3
                    break
                elif word == "hang":
                    await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            self.ended.append((ticket_id, command, "cancelled"))
            raise
        self.ended.append((ticket_id, command, f"exit {code}"))
        yield spb.ExecEvent(exit=spb.ExecExit(code=code))

    async def read_file(self, ticket_id: str, path: str, max_bytes: int = 0) -> spb.ReadFileResponse:
        raise NotFound(f"no file {path!r} in the fake sandbox")

    async def write_file(self, ticket_id: str, path: str, content: bytes) -> int:
        return len(content)

    async def list_dir(self, ticket_id: str, path: str) -> spb.ListDirResponse:
        return spb.ListDirResponse()

    async def search(self, ticket_id: str, pattern: str, path: str = "", regex: bool = False,
                     max_results: int = 0) -> spb.SearchResponse:
        return spb.SearchResponse()


class FakeCredentials:
    """A forge in memory: one branch and one pull request per ticket. `away`
    (a count) makes the next calls fail as a broker that went away would."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.away = 0
        self.prs: dict[str, cpb.PullRequest] = {}
        self.merged: list[tuple[str, str]] = []   # (ticket, approved sha)
        self.merge_acks: list[list[str]] = []     # the acknowledged harness files of each merge
        self.merge_bases: list[str] = []          # the expected base tip of each merge call
        self.base_moves_at_merge = False
        self.checkpoints: list[tuple[str, str]] = []   # (ticket, node) of each CheckpointWorkspace
        self.restored: list[tuple[str, str]] = []      # (ticket, node) of each RestoreWorkspace

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.away > 0:
            self.away -= 1
            raise PeerUnavailable("the credential broker is not running")

    async def prepare(self, ticket_id: str, workspace: str) -> cpb.PrepareWorkspaceResponse:
        self._call("prepare")
        return cpb.PrepareWorkspaceResponse(base_sha="0" * 40, branch=f"afe/{ticket_id}")

    async def commit(self, ticket_id: str, workspace: str, message: str, fence: int = 0) -> cpb.CommitResponse:
        self._call("commit")
        return cpb.CommitResponse(sha="c" * 40, changed=True, files_changed=1)

    async def diff(self, ticket_id: str, workspace: str, max_bytes: int) -> cpb.DiffResponse:
        self._call("diff")
        return cpb.DiffResponse()

    async def push(self, ticket_id: str, workspace: str, fence: int = 0) -> cpb.PushResponse:
        self._call("push")
        return cpb.PushResponse(branch=f"afe/{ticket_id}", sha="c" * 40)

    async def release(self, ticket_id: str, workspace: str) -> None:
        self._call("release")

    async def checkpoint(self, ticket_id: str, workspace: str, node: str,
                         fence: int = 0) -> cpb.CheckpointWorkspaceResponse:
        self._call("checkpoint")
        self.checkpoints.append((ticket_id, node))
        return cpb.CheckpointWorkspaceResponse(sha="k" * 40, node=node)

    async def restore(self, ticket_id: str, workspace: str, node: str,
                      fence: int = 0) -> cpb.CheckpointWorkspaceResponse:
        self._call("restore")
        self.restored.append((ticket_id, node))
        return cpb.CheckpointWorkspaceResponse(sha="k" * 40, node=node)

    async def open_pr(self, ticket_id: str, workspace: str, title: str, body: str,
                      fence: int = 0) -> cpb.PullRequest:
        self._call("open_pr")
        pr = self.prs.setdefault(ticket_id, cpb.PullRequest(
            number=str(len(self.prs) + 1), url=f"local://{ticket_id}", head_branch=f"afe/{ticket_id}",
            base_branch="main", head_sha="c" * 40, state="open"))
        return pr

    async def get_pr(self, workspace: str, number: str) -> cpb.PullRequest:
        self._call("get_pr")
        return next(pr for pr in self.prs.values() if pr.number == number)

    async def merge(self, ticket_id: str, workspace: str, number: str, principal: str, sha: str,
                    at_ms: int, method: str = "", fence: int = 0,
                    accepted_harness_change: Sequence[str] = (),
                    expected_base_sha: str = "") -> cpb.MergePullRequestResponse:
        self._call("merge")
        self.merge_bases.append(expected_base_sha)
        if self.base_moves_at_merge:        # the base moves right before the merge (once)
            self.base_moves_at_merge = False
            raise Aborted("the base branch main moved since the head was verified; it is verified again")
        self.merged.append((ticket_id, sha))
        self.merge_acks.append(list(accepted_harness_change))
        pr = self.prs[ticket_id]
        pr.state, pr.merge_sha = "merged", "m" * 40
        return cpb.MergePullRequestResponse(merged=True, merge_sha=pr.merge_sha)

    async def open_relay(self, ticket_id: str, models: list[str], budget_tokens: int,
                         mcp: Mapping[str, Sequence[str]] | None = None) -> cpb.OpenRelayResponse:
        self._call("open_relay")
        return cpb.OpenRelayResponse(capability="relay-capability")

    async def relay_usage(self, ticket_id: str, mcp_calls_from: int = 0) -> cpb.RelayUsageResponse:
        self._call("relay_usage")
        return cpb.RelayUsageResponse()

    async def complete(self, model: str, messages: list[cpb.Message], tools: list[cpb.ToolSpec],
                       max_tokens: int, ticket_id: str, timeout: float) -> cpb.CompleteResponse:
        self._call("complete")
        return cpb.CompleteResponse(message=cpb.Message(role="assistant", content="done"))

    # The run record (R42): signed with a key of the fake's own, as the broker's signing.py does.
    _signing = Ed25519PrivateKey.generate()

    async def sign_statement(self, ticket_id: str, statement: bytes) -> str:
        self._call("sign_statement")
        raw = self._signing.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        sig = self._signing.sign(attestation.pae(attestation.PAYLOAD_TYPE, statement))
        return attestation.canonical({"payload": base64.b64encode(statement).decode(),
                                      "payloadType": attestation.PAYLOAD_TYPE,
                                      "signatures": [{"keyid": attestation.keyid_of(raw),
                                                      "sig": base64.b64encode(sig).decode()}]}).decode()

    async def signing_key(self) -> cpb.SigningKeyResponse:
        pub = self._signing.public_key()
        raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        pem = pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        return cpb.SigningKeyResponse(public_key_pem=pem.decode(), public_key_raw_b64=base64.b64encode(raw).decode(),
                                      keyid=attestation.keyid_of(raw))


if TYPE_CHECKING:   # mypy checks that the fakes implement the Protocols
    _sandbox: SandboxBroker = FakeSandbox()
    _credentials: CredentialBroker = FakeCredentials()
