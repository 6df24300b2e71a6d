-- Records that outlive a ticket, and recovery (docs/ARCHITECTURE.md, "Retry
-- and records"). Released: never edit, add a new numbered file.
--
-- ticket_diffs: the ticket's last diff against its base, taken before its
-- workspace is released, so `afe ticket show --diff` and the UI show it after
-- the ticket ended.
-- tickets.reopened_at_ms: when the ticket was last re-opened (retry, update
-- branch); an approval older than this is not an approval of the re-run (R16).
-- node_runs.rounds: on_failure rounds this node's failure has sent back;
-- node_runs.feedback: the failure text the latest round gave this node.
ALTER TABLE tickets ADD COLUMN reopened_at_ms INTEGER NOT NULL DEFAULT 0;
ALTER TABLE node_runs ADD COLUMN rounds INTEGER NOT NULL DEFAULT 0;
ALTER TABLE node_runs ADD COLUMN feedback TEXT NOT NULL DEFAULT '';
CREATE TABLE ticket_diffs (
    ticket_id TEXT PRIMARY KEY REFERENCES tickets (id),
    diff TEXT NOT NULL,
    truncated INTEGER NOT NULL,
    at_ms INTEGER NOT NULL
)
