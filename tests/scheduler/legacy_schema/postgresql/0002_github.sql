-- GitHub triggers (docs/GITHUB.md). Released: never edit, add a new numbered file.
--
-- tickets.origin_json: where a ticket came from and which of its texts are
-- untrusted (R36); '{}' for a ticket a person filed in the UI, CLI or API.
-- github_once: keys that may take effect once only: a webhook delivery id
-- (R35: a replayed delivery changes nothing), a polled event id, a refusal
-- comment per issue and user. Written before the effect (at most once).
-- github_poll_cursors: per workspace, the ETag and newest event id seen by
-- the polling mode, so a restart neither replays nor skips events.
ALTER TABLE tickets ADD COLUMN origin_json TEXT NOT NULL DEFAULT '{}';
CREATE TABLE github_once (
    key TEXT PRIMARY KEY,
    at_ms BIGINT NOT NULL
);
CREATE TABLE github_poll_cursors (
    workspace TEXT PRIMARY KEY,
    etag TEXT NOT NULL,
    last_event_id TEXT NOT NULL,
    updated_at_ms BIGINT NOT NULL
)
