-- Sandbox brokers on several hosts (docs/SCALE.md). Released: never edit,
-- add a new numbered file.
--
-- sandbox_placements: the sandbox broker (its --sandbox-broker name) that
-- holds the sandbox of a ticket or of a warm sandbox's reserved id (so no
-- reference to tickets), recorded before the sandbox is created, so every
-- later call of the ticket, also after a scheduler restart, goes to the same
-- broker (services/scheduler/placement.py).
CREATE TABLE sandbox_placements (
    ticket_id TEXT PRIMARY KEY,
    broker TEXT NOT NULL,
    at_ms BIGINT NOT NULL
)
