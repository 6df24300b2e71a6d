"""The scheduler: tickets, workflows, the store and the event log. It holds
no git/forge/model secret and never talks to Docker; it asks the two brokers.

Its parts, one sub-package each (docs/ARCHITECTURE.md, "The scheduler's
layout"):

    store/      the durable state behind one interface (`Store`), its SQLite and
                PostgreSQL back ends, migrations, retries across a lost database
    events/     the event log: per-ticket seqs, group commits, live watchers
    engine/     the tickets' lives: create, capacity, approvals, leases,
                follow-ups and re-opening, what a ticket leaves behind
    executor/   how one ticket's workflow runs (nodes, graph, preparation)
    acp/        agent nodes over the Agent Client Protocol
    sandboxes/  the broker links, sandbox placement, the warm pool, remote
                workspaces and teardown
    github/     GitHub intake (webhooks, polling), review and CI iteration,
                reporting back

and at the top the wiring: `main.py` (composition root), `app.py` (builds
the app from the parts), `servicer.py` (the gRPC layer of the Scheduler
service), `automation_key.py` (the automation caller's key file).

Imports go one way: store <- events, sandboxes <- acp <- executor <- engine
<- github <- the wiring. No module imports one that imports it back
(tests/foundation/test_import_layout.py).
"""
