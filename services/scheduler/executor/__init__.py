"""The executor: how one ticket's workflow runs (see docs/ARCHITECTURE.md,
"The life of a ticket").

    ticket_run.py   TicketRun: stored node runs -> graph -> outcome; one node's attempts
    attempts.py     Attempt: why a run is a new attempt (restart, takeover, self-fencing)
    graph.py        order (graphlib) and fan-out (TaskGroup); the failure rules
    context.py      RunContext: what node kinds share; workspace, relay, sandbox preparation
    nodes/          one module per node kind, dispatched by NODE_KINDS (builtins by BUILTINS)
    brokercalls.py  broker calls that wait through a broker restart (R37)
    transitions.py  every ticket state change: store, event, metric
    host.py         Host: the narrow interface a run has to the engine
    quoting.py      untrusted text in prompts, quoted (R36); templates.py: rendering

May import: services.common, the generated contracts, and the scheduler's
store, events, sandboxes and acp; never the engine (it reaches the engine
only through `Host`) or github/.
"""

from ..sandboxes.spec import relay_models, sandbox_spec
from .context import RunContext
from .host import Host
from .ticket_run import TicketRun
from .transitions import Transitions

__all__ = ["Host", "RunContext", "TicketRun", "Transitions", "relay_models", "sandbox_spec"]
