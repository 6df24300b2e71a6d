-- Verification a cheating agent cannot pass (R41, docs/GUIDE.md
-- "Verification"). Released: never edit, add a new numbered file.
--
-- verifications: a head is now verified MERGED ONTO the base branch's tip,
-- so a head has one row per (base tip, verify: configuration) it was
-- verified with (a moved base or a changed verify: verifies again). kind is
-- 'head' for a ticket's head, 'base' for the base tip's own run of the same
-- commands (the test counts a head must not fall below). The old rows keep
-- their result; their base_sha comes from it, their config is ''.
-- approvals.accepted_harness: the harness files (JSON list) the person
-- acknowledged the head changes (afe approve --accept-harness-change).
CREATE TABLE verification_runs (
    ticket_id TEXT NOT NULL,
    sha TEXT NOT NULL,
    base_sha TEXT NOT NULL,
    config TEXT NOT NULL,
    kind TEXT NOT NULL,
    passed INTEGER NOT NULL,
    result TEXT NOT NULL,
    at_ms INTEGER NOT NULL,
    PRIMARY KEY (ticket_id, sha, base_sha, config, kind)
);
INSERT INTO verification_runs (ticket_id, sha, base_sha, config, kind, passed, result, at_ms)
    SELECT ticket_id, sha, COALESCE(json_extract(result, '$.base_sha'), ''), '', 'head', passed, result, at_ms
    FROM verifications;
DROP TABLE verifications;
ALTER TABLE approvals ADD COLUMN accepted_harness TEXT NOT NULL DEFAULT '[]'
