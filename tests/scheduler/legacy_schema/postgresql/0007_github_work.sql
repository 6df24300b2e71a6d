-- One ticket per piece of work from GitHub, and follow-ups that wait for
-- their re-run (docs/GITHUB.md). Released: never edit, add a new numbered file.
--
-- github_work: the claim of (repository, issue number, Trigger) on its live
-- ticket. The primary key makes the claim atomic (INSERT ... ON CONFLICT):
-- of two deliveries or two schedulers only one starts a ticket, the other
-- joins it. `claim` is a random token of the claimer, `ticket_id` is empty
-- while its ticket is being created. A claim whose ticket has ended, or
-- that has had no stored ticket for a grace period, is replaced by the next
-- event, so a crash never blocks the issue for long (github_intake.py).
-- ticket_followups.state: `given` (an instruction of the re-run since
-- reopened_at_ms, as before), `pending` (received, gathered into or queued
-- for the ticket's next re-open: followups.py), `dropped` (the ticket could
-- not be re-opened for good, its pull request merged: said on the ticket).
CREATE TABLE github_work (
    repo TEXT NOT NULL,
    number BIGINT NOT NULL,
    trigger_name TEXT NOT NULL,
    claim TEXT NOT NULL,
    ticket_id TEXT NOT NULL DEFAULT '',
    claimed_at_ms BIGINT NOT NULL,
    PRIMARY KEY (repo, number, trigger_name)
);
ALTER TABLE ticket_followups ADD COLUMN state TEXT NOT NULL DEFAULT 'given';
CREATE INDEX ticket_followups_pending ON ticket_followups (ticket_id) WHERE state = 'pending'
