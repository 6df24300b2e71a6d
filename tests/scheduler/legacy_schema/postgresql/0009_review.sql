-- Merges a reviewer can trust (docs/GUIDE.md "Verification" and "The run
-- record", docs/GITHUB.md "Failing CI"). Released: never edit, add a new
-- numbered file.
--
-- verifications: the clean-room run of a workflow's verify: commands on one
-- head (R41). A head is verified once per ticket; builtin:merge merges a
-- head only when its row says passed = 1. result is the JSON shown on the
-- approval (commands, exit codes, output tails, base paths).
-- run_records: the signed record of a run for one head (R42): kind
-- 'request' (signed when the approval of sha is asked) or 'decision'
-- (signed again with who approved or rejected it); envelope is the DSSE
-- envelope (JSON) as attached to the pull request.
-- ci_failures: a failing CI head of a ticket's pull request taken as a
-- follow-up (docs/GITHUB.md): one row per (ticket, head), so a failure that
-- GitHub reports by several deliveries, or polling sees again, is one round.
CREATE TABLE verifications (
    ticket_id TEXT NOT NULL,
    sha TEXT NOT NULL,
    passed BIGINT NOT NULL,
    result TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    PRIMARY KEY (ticket_id, sha)
);
CREATE TABLE run_records (
    ticket_id TEXT NOT NULL,
    sha TEXT NOT NULL,
    kind TEXT NOT NULL,
    envelope TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    PRIMARY KEY (ticket_id, sha, kind)
);
CREATE TABLE ci_failures (
    ticket_id TEXT NOT NULL,
    sha TEXT NOT NULL,
    checks TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    PRIMARY KEY (ticket_id, sha)
)
