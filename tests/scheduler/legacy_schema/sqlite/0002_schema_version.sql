-- Which afe wrote each schema version, so that an older afe can name the
-- release it needs (PRAGMA user_version stays the version number).
CREATE TABLE schema_version (
    version INTEGER PRIMARY KEY,
    afe_version TEXT NOT NULL,
    applied_at_ms INTEGER NOT NULL
);
