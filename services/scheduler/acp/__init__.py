"""ACP agent nodes: the engine as an Agent Client Protocol client to coding
agents running inside the ticket's sandbox (see docs/ACP.md).

May import: services.common and the generated contracts; it reaches the
sandbox only through the broker interface its caller passes in.
"""

from .runner import run_agent_node

__all__ = ["run_agent_node"]
