-- idem outbox. One row per outgoing message; every time in it comes from the
-- database clock. state 0 = pending, 1 = published, 2 = dead.
--
-- seq orders the rows: Enqueue takes a transaction-scoped advisory lock on
-- the message key before inserting, so two rows of one key get their seq in
-- commit order. An empty key means "no order".
CREATE TABLE IF NOT EXISTS {{.Table}} (
    seq          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id           uuid        NOT NULL,
    topic        text        NOT NULL,
    key          bytea       NOT NULL,
    key_hash     integer     NOT NULL,
    payload      bytea       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}',
    state        smallint    NOT NULL DEFAULT 0,
    attempts     integer     NOT NULL DEFAULT 0,
    last_error   text,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    available_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    published_at timestamptz,
    dead_at      timestamptz,
    CONSTRAINT {{.Constraint "id"}} UNIQUE (id),
    CHECK (state IN (0, 1, 2)),
    CHECK (key_hash >= 0)
);
-- The relay scans pending rows in seq order.
CREATE INDEX IF NOT EXISTS {{.Index "pending"}} ON {{.Table}} (seq) WHERE state = 0;
-- Keys whose head waits for a retry (few rows).
CREATE INDEX IF NOT EXISTS {{.Index "retry"}} ON {{.Table}} (available_at) WHERE state = 0 AND attempts > 0;
-- Retention of published rows.
CREATE INDEX IF NOT EXISTS {{.Index "published"}} ON {{.Table}} (published_at) WHERE state = 1;
-- Dead rows, for inspection and RequeueDead.
CREATE INDEX IF NOT EXISTS {{.Index "dead"}} ON {{.Table}} (dead_at) WHERE state = 2;
