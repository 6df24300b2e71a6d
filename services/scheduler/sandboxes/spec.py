"""The sandbox a workflow's tickets get on a Workspace (`sandbox_spec`), the
variable names its agents take into it (`agent_env_names`, R9), the
Models its agents reach through the ticket's relay (`relay_models`, R32)
and the MCP servers and tools they reach through it (`relay_mcp`, R43):
used by the executor to create a ticket's sandbox and by the warm pool to
make one before the ticket exists."""

from __future__ import annotations

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.common.config.model import Config, SandboxConfig, Workflow, Workspace

SANDBOX_KINDS = ("run", "model", "agent")


def sandbox_spec(config: Config, workflow: Workflow, workspace: Workspace) -> spb.SandboxSpec:
    """The workspace's sandbox settings plus the env NAMES of the agents this
    workflow uses, and only those (R9). An agent's own image wins."""
    sb = workspace.sandbox
    env_names: set[str] = set()
    image = sb.image
    for n in workflow.nodes:
        if n.kind == "agent" and n.agent in config.agents:
            agent = config.agents[n.agent]
            env_names.update(agent.env)
            if agent.image:
                image = agent.image
    return spb.SandboxSpec(
        image=image,
        limits=spb.Limits(cpus=sb.limits.cpus, memory_bytes=sb.limits.memory_bytes, pids=sb.limits.pids,
                          disk_bytes=sb.limits.disk_bytes),
        egress=list(sb.egress), egress_private=list(sb.egress_private), env_names=sorted(env_names),
        egress_rules=egress_rules_spec(sb),
        relay=bool(relay_models(config, workflow) or relay_mcp(config, workflow)),
        runtime=sb.runtime if sb.runtime != "runc" else "")


def egress_rules_spec(sb: SandboxConfig) -> list[spb.EgressRule]:
    """The methods and paths allowed on the Workspace's hosts with rules (R44),
    for every sandbox of its tickets (the clean room's too)."""
    return [spb.EgressRule(host=r.host, methods=list(r.methods), paths=list(r.paths), name=r.name,
                           ignore_case=r.ignore_case) for r in sb.egress_rules]


def agent_env_names(config: Config, workflow: Workflow) -> dict[str, list[str]]:
    """Agent name -> the variable NAMES it takes into the sandbox (its `env:`, R9), for each
    agent of the workflow that declares any: what the `sandbox.env_names` event lists."""
    out: dict[str, list[str]] = {}
    for n in workflow.nodes:
        agent = config.agents.get(n.agent or "") if n.kind == "agent" else None
        if agent is not None and agent.env:
            out[agent.name] = sorted(agent.env)
    return dict(sorted(out.items()))


def relay_models(config: Config, workflow: Workflow) -> list[str]:
    """The Models the workflow's agents reach through the ticket's relay (R32)."""
    return sorted({config.agents[n.agent].model or "" for n in workflow.nodes
                   if n.kind == "agent" and n.agent in config.agents and config.agents[n.agent].model})


def relay_mcp(config: Config, workflow: Workflow, node_id: str | None = None) -> dict[str, list[str]]:
    """The remote MCP servers, and the tools of each, the workflow's agents (or agent node
    `node_id`) reach through the ticket's relay (R43); a stdio server runs in the sandbox itself."""
    if not any(n.kind == "agent" and (node_id is None or n.id == node_id) for n in workflow.nodes):
        return {}       # a model node's MCP tools are called by the scheduler, never from the sandbox
    out: dict[str, list[str]] = {}
    for g in workflow.mcp_grants(node_id):
        s = config.mcp_servers.get(g.server)
        if s is not None and s.remote:
            out[g.server] = sorted(g.tools)
    return dict(sorted(out.items()))
