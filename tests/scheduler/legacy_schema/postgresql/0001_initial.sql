-- afe 0.1.0: the first PostgreSQL schema, the SQLite schema (versions 1-2)
-- plus what several schedulers sharing one database need. Released: never
-- edit, add a new numbered file.
--
-- tickets.owner / lease_until_ms: reserved for scheduler leases (which
-- scheduler drives a ticket, until when); unused by this afe ('' / 0).
-- event_counters: the last stored seq of each ticket's events; every batch
-- of events moves it forward under its row lock, so a ticket's seqs stay
-- 1..n with no gap and no duplicate whoever writes (pg_store.py).
CREATE TABLE schema_version (
    version INTEGER PRIMARY KEY,
    afe_version TEXT NOT NULL,
    applied_at_ms BIGINT NOT NULL
);
CREATE TABLE tickets (
    rowid BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    workspace TEXT NOT NULL,
    workflow TEXT NOT NULL,
    title TEXT NOT NULL,
    body TEXT NOT NULL,
    inputs_json TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    principal TEXT NOT NULL DEFAULT '',
    error TEXT NOT NULL DEFAULT '',
    tokens_used BIGINT NOT NULL DEFAULT 0,
    awaiting_sha TEXT NOT NULL DEFAULT '',
    torn_down BOOLEAN NOT NULL DEFAULT FALSE,
    owner TEXT NOT NULL DEFAULT '',
    lease_until_ms BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX tickets_state ON tickets (state, rowid);
CREATE TABLE node_runs (
    ticket_id TEXT NOT NULL REFERENCES tickets (id),
    node_id TEXT NOT NULL,
    ord INTEGER NOT NULL,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    needs_json TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,
    started_at_ms BIGINT NOT NULL DEFAULT 0,
    finished_at_ms BIGINT NOT NULL DEFAULT 0,
    output TEXT NOT NULL DEFAULT '',
    error TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (ticket_id, node_id)
);
CREATE TABLE events (
    ticket_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    type TEXT NOT NULL,
    payload_json TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    PRIMARY KEY (ticket_id, seq)
);
CREATE TABLE event_counters (
    ticket_id TEXT PRIMARY KEY,
    last_seq BIGINT NOT NULL
);
CREATE TABLE approvals (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    ticket_id TEXT NOT NULL REFERENCES tickets (id),
    principal TEXT NOT NULL,
    sha TEXT NOT NULL,
    granted BOOLEAN NOT NULL,
    at_ms BIGINT NOT NULL,
    reason TEXT NOT NULL DEFAULT ''
);
CREATE INDEX approvals_ticket ON approvals (ticket_id, id);
CREATE TABLE pull_requests (
    ticket_id TEXT PRIMARY KEY REFERENCES tickets (id),
    number TEXT NOT NULL,
    url TEXT NOT NULL,
    head_branch TEXT NOT NULL,
    base_branch TEXT NOT NULL,
    head_sha TEXT NOT NULL,
    state TEXT NOT NULL,
    merge_sha TEXT NOT NULL DEFAULT ''
);
