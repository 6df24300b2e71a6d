"""The sandbox a workflow's tickets get on a Workspace (`sandbox_spec`), the
variable names its agents take into it (`agent_env_names`, R9) and the
Models its agents reach through the ticket's relay (`relay_models`, R32):
used by the executor to create a ticket's sandbox and by the warm pool to
make one before the ticket exists."""

from __future__ import annotations

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.common.config import Config, Workflow, Workspace

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
        relay=bool(relay_models(config, workflow)), runtime=sb.runtime if sb.runtime != "runc" else "")


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
