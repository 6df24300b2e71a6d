"""The configuration model: frozen dataclasses for the manifest kinds
(`Workspace`, `Model`, `Agent`, `McpServer`, `Workflow`, `Trigger`) and the `Config` that holds them.

`manifests.load_config(dir)` parses and validates YAML into these. Every
process loads the same config directory itself; nothing here ever holds a
secret value, only the NAMES of environment variables (R28).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.config.egress_rules import EgressRule

DEFAULT_SANDBOX_IMAGE = "afe/sandbox:latest"
DEFAULT_PROXY_IMAGE = "afe/proxy:latest"

NODE_TOOLS = ("read_file", "write_file", "list_dir", "search", "run")
BUILTINS = ("commit", "open_pr", "approval", "merge")


@dataclass(frozen=True)
class Limits:
    cpus: float = 1.0
    memory_bytes: int = 1024 * 1024 * 1024
    pids: int = 256
    disk_bytes: int = 10 * 1024 ** 3       # the workspace's disk cap (R34)


@dataclass(frozen=True)
class SandboxConfig:
    image: str = DEFAULT_SANDBOX_IMAGE
    limits: Limits = field(default_factory=Limits)
    egress: tuple[str, ...] = ()          # empty => --network none (R10)
    # operator-allowed private destinations: names (also in egress) and CIDRs (R11)
    egress_private: tuple[str, ...] = ()
    # methods and paths allowed on hosts of `egress` that have rules (R44, egress_rules.py);
    # a host of `egress` without rules is reached by CONNECT pass-through
    egress_rules: tuple[EgressRule, ...] = ()
    # warm sandboxes kept ready per profile of this workspace (services/scheduler/sandboxes/pool.py)
    pool: int = 0
    # the OCI runtime: runc (namespaces, the host's kernel) or gvisor (runsc: a
    # user-space kernel; egress then goes through a Unix socket, docs/SECURITY.md)
    runtime: str = "runc"


@dataclass(frozen=True)
class ForgeConfig:
    type: str                              # github | local
    repo: str = ""                         # github: owner/name
    base_url: str = "https://api.github.com"
    merge_method: str = "merge"            # merge | squash | rebase
    # github: owner/name of a fork the ticket's branch is pushed to; the pull request
    # is opened from it (head "<owner>:<branch>"), so the base's CI runs it as a fork PR
    push_repo: str = ""


@dataclass(frozen=True)
class Author:
    name: str = "afe"
    email: str = "afe@localhost"


@dataclass(frozen=True)
class Workspace:
    name: str
    repo: str                              # https URL, or a local path / file:// URL
    base_branch: str = "main"
    token_env: str | None = None           # NAME of the env var holding the token
    forge: ForgeConfig = field(default_factory=lambda: ForgeConfig(type="local"))
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    author: Author = field(default_factory=Author)
    max_running: int = 0                   # 0 = only the global limit applies
    # paths where builtin:commit may add compiled files (services/common/provenance/bytecode.py)
    allow_compiled_paths: tuple[str, ...] = ()
    # more harness files for verify: (R41), beside the ones afe knows (services/credentials/verification/harness.py)
    verify_harness: tuple[str, ...] = ()
    source: str = ""                       # "file.yaml#2" for error messages

    @property
    def is_local(self) -> bool:
        return not self.repo.startswith("https://")


@dataclass(frozen=True)
class Model:
    name: str
    provider: str                          # openai | anthropic | gemini | replay
    model: str = ""
    base_url: str = ""
    api_key_env: str | None = None
    script: Path | None = None             # replay: the script file (absolute)
    max_tokens: int = 4096
    timeout_s: float = 120.0
    source: str = ""
    # USD per million tokens (input, output), for the cost estimate (services/common/cost.py); None: unpriced
    price: tuple[float, float] | None = None


@dataclass(frozen=True)
class Agent:
    name: str
    type: str                              # acp
    command: tuple[str, ...]
    env: tuple[str, ...] = ()              # NAMES passed into the sandbox (R9)
    image: str | None = None
    model: str | None = None               # a Model name: reached through the ticket's relay (R32)
    # env var NAME -> template of {base_url} / {capability} / {model}, set in the agent's
    # process (never the container); empty = the provider's default (services/common/relayenv.py)
    relay_env: tuple[tuple[str, str], ...] = ()
    preset: str | None = None              # claude-code | codex | gemini | opencode (services/common/config/presets.py)
    # env var NAME -> literal, non-secret value (a tool's "no telemetry" switch), set in the
    # agent's process like relay_env; validated by presets.check_fixed_env
    fixed_env: tuple[tuple[str, str], ...] = ()
    source: str = ""


MCP_TRANSPORTS = ("http", "sse", "stdio")   # Streamable HTTP | legacy HTTP+SSE | a process in the sandbox
MCP_ALL_TOOLS = "all"                     # a stdio server's grant: afe cannot filter what it does not relay


@dataclass(frozen=True)
class McpServer:
    """An MCP server agents and model nodes may use (docs/MCP.md). Remote (`http`,
    `sse`): reached only through the credential broker's relay, which alone holds the
    credential named by `token_env` and sends it as `Authorization: Bearer <token>`
    or, with `header`, as `<header>: <token>` (R43). Local (`stdio`): `command` runs
    inside the ticket's sandbox and gets no secret."""
    name: str
    transport: str                         # http | sse | stdio (MCP_TRANSPORTS)
    url: str = ""                          # remote: https://, or http:// to loopback
    token_env: str | None = None           # remote: NAME of the variable holding the credential
    header: str | None = None              # remote: the header carrying the token; None = Authorization: Bearer
    command: tuple[str, ...] = ()          # stdio: the argv inside the sandbox
    timeout_s: float = 60.0                # remote: seconds per request through the relay
    source: str = ""

    @property
    def remote(self) -> bool:
        return self.transport != "stdio"

    def auth_header(self, token: str) -> tuple[str, str]:
        """(header name, value) the relay adds for `token`; never put into a sandbox."""
        return (self.header, token) if self.header else ("Authorization", f"Bearer {token}")


@dataclass(frozen=True)
class McpGrant:
    """The tools of one MCP server a workflow's agents (Workflow.mcp) or a model node
    (Node.mcp) may call; `tools == (MCP_ALL_TOOLS,)` only for a stdio server."""
    server: str
    tools: tuple[str, ...]

    def allows(self, tool: str) -> bool:
        return tool in self.tools or self.tools == (MCP_ALL_TOOLS,)


@dataclass(frozen=True)
class Node:
    id: str
    kind: str                              # run | model | agent | builtin
    needs: tuple[str, ...] = ()
    timeout_s: float = 1800.0
    retries: int = 0
    run: str | None = None                 # run: shell command
    model: str | None = None               # model: Model name
    agent: str | None = None               # agent: Agent name
    uses: str | None = None                # builtin name without the "builtin:" prefix
    prompt: str = ""
    tools: tuple[str, ...] = ()            # model: afe's own tools (NODE_TOOLS)
    mcp: tuple[McpGrant, ...] = ()         # model: the MCP tools of `tools: [mcp:SERVER/TOOL]`, by server
    max_turns: int = 20
    max_tokens: int = 0                    # per-node token budget; 0 = none
    deny: tuple[str, ...] = ()             # agent: permission kinds to deny
    with_: dict[str, Any] = field(default_factory=dict)  # builtin options (title, body, method)
    # on_failure: {retry_from: ID, max: N}: this node's failure text goes back to the
    # model/agent node ID (an ancestor), which runs again with it, at most N rounds.
    retry_from: str | None = None
    retry_max: int = 0

    @property
    def label(self) -> str:
        return f"builtin:{self.uses}" if self.kind == "builtin" else self.kind


@dataclass(frozen=True)
class Verify:
    """`verify:` of a Workflow (R41): commands run on the head a person is asked to
    approve, in a fresh sandbox of a fresh checkout, `base_paths` taken from the base branch."""
    run: tuple[str, ...]                   # templated like a run: node (values as $1.., R36)
    base_paths: tuple[str, ...] = ()       # relative paths taken from the base branch's tip
    timeout_s: float = 900.0               # per command


@dataclass(frozen=True)
class Workflow:
    name: str
    nodes: tuple[Node, ...]
    workspace: str | None = None           # default workspace for tickets
    inputs: tuple[str, ...] = ()           # names a ticket may set
    input_defaults: tuple[tuple[str, str], ...] = ()   # (name, value) of the optional inputs
    max_tokens: int = 0                    # per-ticket token budget; 0 = none
    source: str = ""
    ci_rounds: int = 0                     # on_ci_failure.max: CI follow-up rounds at most; 0 = none
    verify: Verify | None = None           # clean-room verification before the approval (R41)
    mcp: tuple[McpGrant, ...] = ()         # `mcp: {SERVER: [TOOL, ...]}`: what the agent nodes may call

    @property
    def required_inputs(self) -> tuple[str, ...]:
        """Declared inputs without a default: a ticket must set them."""
        optional = {k for k, _ in self.input_defaults}
        return tuple(n for n in self.inputs if n not in optional)

    def node(self, node_id: str) -> Node:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def mcp_grants(self, node_id: str | None = None) -> tuple[McpGrant, ...]:
        """The MCP allowlist of one node: a model node's own `tools: [mcp:...]`, an agent
        node's the workflow's `mcp:`; without a node, the workflow's `mcp:`."""
        if node_id is not None:
            node = self.node(node_id)
            if node.kind == "model":
                return node.mcp
            if node.kind != "agent":
                return ()
        return self.mcp

    def mcp_server_names(self) -> tuple[str, ...]:
        """Every MCP server a ticket of this workflow may reach (its agents' and model nodes')."""
        names = {g.server for g in self.mcp} | {g.server for n in self.nodes for g in n.mcp}
        return tuple(sorted(names))


# What a Trigger maps into a workflow input: fields of the GitHub event, all
# written by people outside the engine and so marked untrusted (R36).
TRIGGER_FIELDS = ("title", "body", "url", "number", "author", "command")


@dataclass(frozen=True)
class Trigger:
    """Work started from GitHub (docs/GITHUB.md): an issue labelled with one
    of `labels`, assigned to one of `assignees`, or a comment starting with
    `command` creates a ticket on `workflow` in `workspace` (a github forge)."""
    name: str
    workspace: str
    workflow: str
    labels: tuple[str, ...] = ()
    assignees: tuple[str, ...] = ()
    command: str = ""                      # e.g. "/afe"; "" = comments start nothing
    inputs: tuple[tuple[str, str], ...] = ()   # workflow input name -> one of TRIGGER_FIELDS
    poll: bool = False                     # poll the repository's events (no public URL)
    source: str = ""


@dataclass(frozen=True)
class Config:
    directory: Path
    workspaces: dict[str, Workspace] = field(default_factory=dict)
    models: dict[str, Model] = field(default_factory=dict)
    agents: dict[str, Agent] = field(default_factory=dict)
    workflows: dict[str, Workflow] = field(default_factory=dict)
    triggers: dict[str, Trigger] = field(default_factory=dict)
    mcp_servers: dict[str, McpServer] = field(default_factory=dict)

    def credential_env_names(self) -> list[str]:
        """Variables the credential broker receives: every tokenEnv (Workspace, McpServer) and apiKeyEnv."""
        return sorted(self.secret_env_names())

    def secret_env_names(self) -> dict[str, tuple[str, str]]:
        """NAME -> (kind, name) of the manifest that holds a secret in it, e.g. ("Model", "claude"):
        every Workspace and McpServer tokenEnv and Model apiKeyEnv, the names no Agent's env may list (R43)."""
        out: dict[str, tuple[str, str]] = {}
        for w in self.workspaces.values():
            if w.token_env:
                out.setdefault(w.token_env, ("Workspace", w.name))
        for m in self.models.values():
            if m.api_key_env:
                out.setdefault(m.api_key_env, ("Model", m.name))
        for s in self.mcp_servers.values():
            if s.token_env:
                out.setdefault(s.token_env, ("McpServer", s.name))
        return out

    def agent_env_names(self) -> list[str]:
        """Variables the sandbox broker receives: every name an acp agent declares."""
        return sorted({n for a in self.agents.values() for n in a.env})
