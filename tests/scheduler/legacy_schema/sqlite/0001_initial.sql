-- afe 0.1.0: the first schema. Released: never edit, add a new numbered file.
CREATE TABLE tickets (
    rowid INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    workspace TEXT NOT NULL,
    workflow TEXT NOT NULL,
    title TEXT NOT NULL,
    body TEXT NOT NULL,
    inputs_json TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL,
    updated_at_ms INTEGER NOT NULL,
    principal TEXT NOT NULL DEFAULT '',
    error TEXT NOT NULL DEFAULT '',
    tokens_used INTEGER NOT NULL DEFAULT 0,
    awaiting_sha TEXT NOT NULL DEFAULT '',
    torn_down INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX tickets_state ON tickets(state, rowid);
CREATE TABLE node_runs (
    ticket_id TEXT NOT NULL REFERENCES tickets(id),
    node_id TEXT NOT NULL,
    ord INTEGER NOT NULL,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    needs_json TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,
    started_at_ms INTEGER NOT NULL DEFAULT 0,
    finished_at_ms INTEGER NOT NULL DEFAULT 0,
    output TEXT NOT NULL DEFAULT '',
    error TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (ticket_id, node_id)
);
CREATE TABLE events (
    ticket_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    type TEXT NOT NULL,
    payload_json TEXT NOT NULL,
    at_ms INTEGER NOT NULL,
    PRIMARY KEY (ticket_id, seq)
) WITHOUT ROWID;
CREATE TABLE approvals (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ticket_id TEXT NOT NULL REFERENCES tickets(id),
    principal TEXT NOT NULL,
    sha TEXT NOT NULL,
    granted INTEGER NOT NULL,
    at_ms INTEGER NOT NULL,
    reason TEXT NOT NULL DEFAULT ''
);
CREATE TABLE pull_requests (
    ticket_id TEXT PRIMARY KEY REFERENCES tickets(id),
    number TEXT NOT NULL,
    url TEXT NOT NULL,
    head_branch TEXT NOT NULL,
    base_branch TEXT NOT NULL,
    head_sha TEXT NOT NULL,
    state TEXT NOT NULL,
    merge_sha TEXT NOT NULL DEFAULT ''
);
