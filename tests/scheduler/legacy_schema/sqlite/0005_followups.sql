-- Follow-ups and reporting back to GitHub (docs/GITHUB.md, "Iteration" and
-- "Reporting back"). Released: never edit, add a new numbered file.
--
-- ticket_followups: the instructions a re-opened ticket's model and agent
-- nodes get (`afe ticket followup`, a review on the ticket's pull request),
-- untrusted text quoted in the prompt (R36).
-- github_reports: per ticket and step (started, final, status, ...) the
-- GitHub comment afe wrote and a digest of what it last said, so a report is
-- edited rather than posted again, also after a crash (R37).
CREATE TABLE ticket_followups (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ticket_id TEXT NOT NULL REFERENCES tickets (id),
    at_ms INTEGER NOT NULL,
    author TEXT NOT NULL,
    source TEXT NOT NULL,
    text TEXT NOT NULL,
    path TEXT NOT NULL,
    line INTEGER NOT NULL,
    url TEXT NOT NULL
);
CREATE INDEX ticket_followups_ticket ON ticket_followups (ticket_id, at_ms);
CREATE TABLE github_reports (
    ticket_id TEXT NOT NULL,
    step TEXT NOT NULL,
    comment_id TEXT NOT NULL,
    digest TEXT NOT NULL,
    at_ms INTEGER NOT NULL,
    PRIMARY KEY (ticket_id, step)
)
