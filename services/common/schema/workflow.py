"""kind: Workflow — the nodes a ticket runs (run, model, agent, builtin),
their order (needs), budgets (maxTokens), the inputs a ticket may set and
the MCP tools its agents may call (`mcp: {SERVER: [TOOL, ...]}`; a model
node lists its own as `tools: [mcp:SERVER/TOOL]`, docs/MCP.md).

`WorkflowManifest` and the node models declare the fields; `load` checks
one document and adds a `config.Workflow`. References to other documents
(workspace, model, agent) are checked by the loader once all are read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from services.common.config.model import BUILTINS, MCP_ALL_TOOLS, NODE_TOOLS, McpGrant, Node, Workflow

from .document import Doc
from .text import INPUT_RE, INPUT_WHAT, MCP_NODE_TOOL_RE, MCP_TOOL_RE, NAME_RE, NODE_ID_RE, fields_of, show
from .verify import VerifyDecl, load_verify
from .workspace import MERGE_METHODS

if TYPE_CHECKING:
    from .collected import Collected as Loader

# ACP tool-call kinds an agent node may deny.
PERMISSION_KINDS = ("read", "edit", "delete", "move", "search", "execute", "think", "fetch",
                    "switch_mode", "other")
BUILTIN_WITH = {
    "commit": ("message",),
    "open_pr": ("title", "body"),
    "approval": ("message",),
    "merge": ("method",),
}

_STRICT = ConfigDict(extra="forbid", populate_by_name=True)
NodeId = Annotated[str, StringConstraints(pattern=NODE_ID_RE.pattern)]
McpToolName = Annotated[str, StringConstraints(pattern=MCP_TOOL_RE.pattern)]
McpNodeTool = Annotated[str, StringConstraints(pattern=MCP_NODE_TOOL_RE.pattern)]
McpServerName = Annotated[str, StringConstraints(pattern=NAME_RE.pattern)]
TOOLS_WHAT = f"use one of: {', '.join(NODE_TOOLS)}, or mcp:SERVER/TOOL (a tool of an McpServer)"


class OnFailure(BaseModel):
    """Send this node's failure (its output's tail) back to an earlier model or
    agent node, which runs again with it; the nodes between run again too."""
    model_config = _STRICT
    retry_from: NodeId = Field(description="a model or agent node this node needs (directly or not)")
    max: int = Field(3, ge=1, le=20, description="rounds at most; then the node fails")


class OnCiFailure(BaseModel):
    """Failing CI on the head of afe's pull request (GitHub) becomes a follow-up
    of the ticket (docs/GITHUB.md, "Failing CI"), for this many rounds at most."""
    model_config = _STRICT
    max: int = Field(3, ge=1, le=20, description="CI rounds at most; then a comment asks a person to look")


class _NodeBase(BaseModel):
    model_config = _STRICT
    id: NodeId
    needs: list[NodeId] = Field(default_factory=list, description="ids of nodes that must finish first")
    timeout: float = Field(1800.0, gt=0, description="seconds")
    retries: int = Field(0, ge=0)
    on_failure: OnFailure | None = None


class RunNode(_NodeBase):
    """A shell command in the ticket's sandbox."""
    run: Annotated[str, StringConstraints(min_length=1)]


class ModelNode(_NodeBase):
    """A tool-using model loop driven by the engine."""
    model: Annotated[str, StringConstraints(min_length=1)] = Field(description="a Model name")
    prompt: str
    tools: list[Literal[NODE_TOOLS] | McpNodeTool] = Field(  # type: ignore[valid-type]
        default_factory=list, description="afe's tools, and MCP tools as mcp:SERVER/TOOL (docs/MCP.md)")
    max_turns: int = Field(20, ge=1)
    max_tokens: int = Field(0, ge=0, description="token budget of this node; 0 = none")


class AgentNode(_NodeBase):
    """An ACP agent (an Agent manifest) in the ticket's sandbox."""
    agent: Annotated[str, StringConstraints(min_length=1)] = Field(description="an Agent name")
    prompt: str
    deny: list[Literal[PERMISSION_KINDS]] = Field(default_factory=list)  # type: ignore[valid-type]
    max_tokens: int = Field(0, ge=0, description="token budget of this node; 0 = none")


class BuiltinWith(BaseModel):
    """Options of a builtin: commit/approval take message, open_pr title and body, merge method."""
    model_config = _STRICT
    message: str | None = None
    title: str | None = None
    body: str | None = None
    method: Literal["merge", "squash", "rebase"] | None = None


class BuiltinNode(_NodeBase):
    """A step of the engine itself: commit, open_pr, approval or merge."""
    uses: Literal[tuple(f"builtin:{b}" for b in BUILTINS)]  # type: ignore[valid-type]
    with_: BuiltinWith | None = Field(None, alias="with")


NODE_MODELS: dict[str, type[_NodeBase]] = {"run": RunNode, "model": ModelNode, "agent": AgentNode,
                                           "uses": BuiltinNode}
_COMMON = fields_of(_NodeBase)


class InputDecl(BaseModel):
    """An input with a default: a ticket that does not set it gets the default."""
    model_config = _STRICT
    name: Annotated[str, StringConstraints(pattern=INPUT_RE.pattern)]
    default: str = Field(description="the value of a ticket that does not set this input")
    description: str = ""


class WorkflowManifest(BaseModel):
    """The nodes a ticket runs."""
    model_config = _STRICT
    kind: Literal["Workflow"]
    name: Annotated[str, StringConstraints(pattern=NAME_RE.pattern)]
    workspace: str | None = Field(None, description="the Workspace of tickets that name none")
    inputs: list[Annotated[str, StringConstraints(pattern=INPUT_RE.pattern)] | InputDecl] = Field(
        default_factory=list, description="inputs of a ticket: a NAME (required) or {name, default} (optional)")
    maxTokens: int = Field(0, ge=0, description="token budget of a ticket; 0 = none")
    nodes: list[RunNode | ModelNode | AgentNode | BuiltinNode] = Field(min_length=1)
    on_ci_failure: OnCiFailure | None = Field(None, description="iterate on failing CI of the pull request")
    verify: VerifyDecl | None = Field(None, description="clean-room verification of the head before merge (R41)")
    mcp: dict[McpServerName, list[McpToolName] | Literal["all"]] = Field(
        default_factory=dict, description="McpServer name -> the tools its agent nodes may call (a stdio "
        "server: all)")


def load(loader: Loader, doc: Doc, d: Mapping[str, Any], name: str | None) -> None:
    doc.fields(d, "", fields_of(WorkflowManifest), ("nodes",))
    workspace = doc.text(d, "workspace", "workspace", None)
    inputs, defaults = _inputs(doc, d)
    max_tokens = doc.integer(d, "maxTokens", "maxTokens", 0, minimum=0)
    ci_rounds = _on_ci_failure(doc, d)
    verify = load_verify(doc, d)
    mcp = _mcp(doc, d)
    raw_nodes = d.get("nodes")
    nodes: list[Node] = []
    if raw_nodes is not None and not isinstance(raw_nodes, list):
        doc.error("nodes", "must be a list of nodes (- id: ...)")
    elif isinstance(raw_nodes, list):
        if not raw_nodes:
            doc.error("nodes", "must not be empty; add at least one node")
        ids: set[str] = set()
        for i, raw in enumerate(raw_nodes):
            node = _node(loader, doc, raw, f"nodes[{i}]")
            if node is None:
                continue
            if node.id in ids:
                doc.error(f"nodes[{i}].id", f"node id {show(node.id)} is used twice; ids must be unique "
                          "within a workflow")
                continue
            ids.add(node.id)
            nodes.append(node)
    if doc.named and name is not None and "nodes" in d:
        loader.workflows[name] = Workflow(name=name, nodes=tuple(nodes), workspace=workspace, inputs=inputs,
                                        input_defaults=defaults, max_tokens=max_tokens, source=doc.where,
                                        ci_rounds=ci_rounds, verify=verify, mcp=mcp)
        loader._raw_nodes[name] = raw_nodes if isinstance(raw_nodes, list) else []


def _mcp(doc: Doc, d: Mapping[str, Any]) -> tuple[McpGrant, ...]:
    """`mcp: {SERVER: [TOOL, ...]}` (or SERVER: all for a stdio server): the agents' MCP grants.
    That each server exists and which form it takes is checked once every document is read."""
    raw = doc.mapping(d, "mcp", "mcp")
    if raw is None:
        return ()
    grants: list[McpGrant] = []
    for server, tools in raw.items():
        if not isinstance(server, str) or not NAME_RE.match(server):
            doc.error("mcp", f"{show(server)} is not an McpServer name; write mcp: {{SERVER: [tool, ...]}}")
            continue
        path = f"mcp.{server}"
        if tools == MCP_ALL_TOOLS:
            grants.append(McpGrant(server=server, tools=(MCP_ALL_TOOLS,)))
            continue
        if not isinstance(tools, list) or not tools:
            doc.error(path, f"list the tools the agents may call, e.g. mcp: {{{server}: [get_issue, "
                      "search_issues]}} (an empty list allows nothing: remove the server instead)")
            continue
        names = doc.str_list(raw, server, path, pattern=MCP_TOOL_RE,
                             what="write an MCP tool's name (letters, digits, '_', '-', '.')")
        if MCP_ALL_TOOLS in names:
            doc.error(path, f"{MCP_ALL_TOOLS!r} is the whole value (SERVER: all), not an item of a list")
            continue
        if names:
            grants.append(McpGrant(server=server, tools=names))
    return tuple(grants)


def _model_tools(doc: Doc, raw: Mapping[str, Any], path: str) -> tuple[tuple[str, ...], tuple[McpGrant, ...]]:
    """A model node's `tools:`: afe's own (NODE_TOOLS) and `mcp:SERVER/TOOL`, grouped by server."""
    items = set(doc.str_list(raw, "tools", path))   # non-empty text, no duplicates
    listed = raw.get("tools")
    own: list[str] = []
    by_server: dict[str, list[str]] = {}
    for i, item in enumerate(listed if isinstance(listed, list) else []):
        if not isinstance(item, str) or item not in items:
            continue   # refused above
        items.discard(item)
        if item in NODE_TOOLS:
            own.append(item)
            continue
        m = MCP_NODE_TOOL_RE.match(item)
        if m is None:
            what = ("write mcp:SERVER/TOOL (an McpServer's name, '/', one of its tools)"
                    if item.startswith("mcp:") else TOOLS_WHAT)
            doc.error(f"{path}[{i}]", f"{show(item)} is not one of afe's tools; {what}")
            continue
        by_server.setdefault(m.group(1), []).append(m.group(2))
    return tuple(own), tuple(McpGrant(server=s, tools=tuple(t)) for s, t in by_server.items())


def _on_ci_failure(doc: Doc, d: Mapping[str, Any]) -> int:
    """`on_ci_failure: {max: N}`: CI follow-up rounds at most (default 3); 0 without it."""
    if "on_ci_failure" not in d:
        return 0
    ci = d.get("on_ci_failure")
    if not isinstance(ci, dict):
        doc.error("on_ci_failure", "must be a mapping: on_ci_failure: {max: 3} ({} for 3 rounds); remove it "
                  "to start no follow-up on failing CI")
        return 0
    doc.fields(ci, "on_ci_failure", fields_of(OnCiFailure))
    rounds = doc.integer(ci, "max", "on_ci_failure.max", 3, minimum=1)
    if rounds > 20:
        doc.error("on_ci_failure.max", "at most 20 rounds; lower it")
        return 0
    return rounds


def _inputs(doc: Doc, d: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """`inputs:` — each a NAME (a ticket must set it) or {name, default[, description]}."""
    raw = d.get("inputs")
    if raw is None:
        return (), ()
    if not isinstance(raw, list):
        doc.error("inputs", "must be a list of input names, or {name: NAME, default: VALUE}")
        return (), ()
    names: list[str] = []
    defaults: list[tuple[str, str]] = []
    for i, item in enumerate(raw):
        p = f"inputs[{i}]"
        default: str | None = None
        if isinstance(item, dict):
            doc.fields(item, p, fields_of(InputDecl), ("name", "default"))
            name, default = item.get("name"), item.get("default")
            if default is not None and not isinstance(default, str):
                doc.error(f"{p}.default", "must be text; quote it (default: \"42\")")
                default = None
            if "default" not in item:
                continue
        else:
            name = item
        if not isinstance(name, str) or not INPUT_RE.match(name):
            doc.error(p if not isinstance(item, dict) else f"{p}.name",
                      f"{show(name)} is not a valid input name; {INPUT_WHAT}")
            continue
        if name in names:
            doc.error(p, f"{show(name)} is listed twice; remove the duplicate")
            continue
        names.append(name)
        if default is not None:
            defaults.append((name, default))
    return tuple(names), tuple(defaults)


def _node(loader: Loader, doc: Doc, raw: Any, path: str) -> Node | None:
    if not isinstance(raw, dict):
        doc.error(path, "must be a mapping with id and one of run / model / agent / uses")
        return None
    present = [k for k in ("run", "model", "agent", "uses") if k in raw]
    if len(present) != 1:
        every = _COMMON + tuple(k for m in NODE_MODELS.values() for k in fields_of(m) if k not in _COMMON)
        doc.fields(raw, path, every, ("id",))
        doc.error(path, "a node needs exactly one of run: (a command), model: (a Model name), "
                  f"agent: (an Agent name) or uses: (builtin:{'|'.join(BUILTINS)}); "
                  + ("it has none" if not present else f"it has {' and '.join(present)}"))
        return None
    which = present[0]
    doc.fields(raw, path, fields_of(NODE_MODELS[which]), ("id",),
               hint=f" (a {which} node)")
    node_id = doc.text(raw, "id", f"{path}.id", None, pattern=NODE_ID_RE,
                       what="use letters, digits, '_' and '-'")
    needs = doc.str_list(raw, "needs", f"{path}.needs", pattern=NODE_ID_RE,
                         what="list node ids of this workflow")
    timeout = doc.number(raw, "timeout", f"{path}.timeout", 1800.0)
    retries = doc.integer(raw, "retries", f"{path}.retries", 0, minimum=0)
    kw: dict[str, Any] = {}
    on_failure = doc.mapping(raw, "on_failure", f"{path}.on_failure")
    if on_failure is not None:
        doc.fields(on_failure, f"{path}.on_failure", fields_of(OnFailure), ("retry_from",))
        kw["retry_from"] = doc.text(on_failure, "retry_from", f"{path}.on_failure.retry_from", None,
                                    pattern=NODE_ID_RE, what="name a model or agent node this node needs")
        kw["retry_max"] = doc.integer(on_failure, "max", f"{path}.on_failure.max", 3, minimum=1)
        if kw["retry_max"] > 20:
            doc.error(f"{path}.on_failure.max", "at most 20 rounds; lower it")
    if which == "run":
        kind = "run"
        kw["run"] = doc.text(raw, "run", f"{path}.run", None)
        if kw["run"] is None:
            return None
    elif which == "model":
        kind = "model"
        kw["model"] = doc.text(raw, "model", f"{path}.model", None)
        kw["prompt"] = doc.text(raw, "prompt", f"{path}.prompt", "")
        if "prompt" not in raw:
            doc.error(f"{path}.prompt", "a model node needs a prompt; add prompt: ...")
        kw["tools"], kw["mcp"] = _model_tools(doc, raw, f"{path}.tools")
        kw["max_turns"] = doc.integer(raw, "max_turns", f"{path}.max_turns", 20, minimum=1)
        kw["max_tokens"] = doc.integer(raw, "max_tokens", f"{path}.max_tokens", 0, minimum=0)
    elif which == "agent":
        kind = "agent"
        kw["agent"] = doc.text(raw, "agent", f"{path}.agent", None)
        kw["prompt"] = doc.text(raw, "prompt", f"{path}.prompt", "")
        if "prompt" not in raw:
            doc.error(f"{path}.prompt", "an agent node needs a prompt; add prompt: ...")
        kw["deny"] = doc.str_list(raw, "deny", f"{path}.deny", choices=PERMISSION_KINDS)
        kw["max_tokens"] = doc.integer(raw, "max_tokens", f"{path}.max_tokens", 0, minimum=0)
    else:
        kind = "builtin"
        uses = raw.get("uses")
        builtin = uses[len("builtin:"):] if isinstance(uses, str) and uses.startswith("builtin:") else None
        if builtin not in BUILTINS:
            doc.error(f"{path}.uses", f"{show(uses)} is not a builtin; use one of "
                      + ", ".join(f"builtin:{b}" for b in BUILTINS))
            return None
        kw["uses"] = builtin
        with_ = doc.mapping(raw, "with", f"{path}.with") or {}
        allowed = BUILTIN_WITH[builtin]
        doc.fields(with_, f"{path}.with", allowed, hint=f" (builtin:{builtin})")
        clean: dict[str, Any] = {}
        for k in allowed:
            v = doc.text(with_, k, f"{path}.with.{k}", None)
            if v is not None:
                clean[k] = v
        if "method" in clean and clean["method"] not in MERGE_METHODS:
            doc.error(f"{path}.with.method", f"is not one of: {', '.join(MERGE_METHODS)}")
            clean.pop("method")
        kw["with_"] = clean
    if node_id is None:
        return None
    return Node(id=node_id, kind=kind, needs=needs, timeout_s=timeout, retries=retries, **kw)

