-- idem outbox on SQLite. One row per outgoing message; times are Unix
-- microseconds (UTC). state 0 = pending, 1 = published, 2 = dead.
--
-- seq orders the rows. SQLite has one writer at a time, so rows get their
-- seq in commit order. key_hash is 0 for a keyless message (no order) and a
-- positive hash of the key otherwise.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    id           TEXT    NOT NULL,
    topic        TEXT    NOT NULL,
    msg_key      BLOB    NOT NULL,
    key_hash     INTEGER NOT NULL,
    payload      BLOB    NOT NULL,
    headers      TEXT    NOT NULL DEFAULT '{}',
    state        INTEGER NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2)),
    attempts     INTEGER NOT NULL DEFAULT 0,
    last_error   TEXT,
    created_at   INTEGER NOT NULL,
    available_at INTEGER NOT NULL,
    published_at INTEGER,
    dead_at      INTEGER
);
CREATE UNIQUE INDEX IF NOT EXISTS {{.Index "id"}} ON {{.Table}} (id);
-- The relay scans pending rows in seq order.
CREATE INDEX IF NOT EXISTS {{.Index "pending"}} ON {{.Table}} (seq) WHERE state = 0;
-- A key's earlier pending rows.
CREATE INDEX IF NOT EXISTS {{.Index "key"}} ON {{.Table}} (key_hash, seq) WHERE state = 0;
-- Retention of published and dead rows.
CREATE INDEX IF NOT EXISTS {{.Index "published"}} ON {{.Table}} (published_at) WHERE state = 1;
CREATE INDEX IF NOT EXISTS {{.Index "dead"}} ON {{.Table}} (dead_at) WHERE state = 2;
