"""Where a ticket's sandbox lives and how it goes away: the clients of the
two brokers (brokers.py), several sandbox brokers as one (placement.py), warm
sandboxes (pool.py), workspaces of a sandbox on another host
(remoteworkspace.py), the Commands stream (commandstream.py), teardown and
reconcile (teardown.py), and the report of refused egress (egress_report.py).

May import: services.common, the generated contracts, the scheduler's store
and events; not the engine, executor or github/.
"""
