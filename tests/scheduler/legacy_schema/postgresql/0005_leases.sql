-- Several schedulers on one database (docs/SCALE.md). Released: never edit,
-- add a new numbered file.
--
-- tickets.owner / lease_until_ms (reserved since 0001) are now used: the
-- scheduler that drives a live ticket and until when (the database's clock,
-- ms) its lease holds; it renews it by heartbeat, another takes the ticket
-- over once it has expired.
-- tickets.fence: bumped by every claim. Every write of the owner checks
-- owner and fence (SELECT ... FOR SHARE in the write's transaction), and
-- every side effect is preceded by the same check, so a scheduler whose
-- ticket was taken over can neither write nor push (R37).
-- tickets.cancel_by: a cancel asked of a scheduler that does not drive the
-- ticket; its owner sees it on its next heartbeat.
ALTER TABLE tickets ADD COLUMN fence BIGINT NOT NULL DEFAULT 0;
ALTER TABLE tickets ADD COLUMN cancel_by TEXT NOT NULL DEFAULT '';
CREATE INDEX tickets_lease ON tickets (state, lease_until_ms);
