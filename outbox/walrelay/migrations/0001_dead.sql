-- idem WAL relay: messages it parked after their last failed attempt (or
-- could not decode). The write-ahead log cannot skip a message silently, so
-- a message the broker keeps refusing is copied here and the relay moves
-- past it. id is the message id (for a logical message that could not be
-- decoded, a UUID derived from its LSN); lsn is the end of the transaction
-- that wrote it. RequeueDead enqueues a parked message again with its id.
CREATE TABLE IF NOT EXISTS {{.Dead}} (
    id          uuid        PRIMARY KEY,
    topic       text        NOT NULL,
    key         bytea       NOT NULL,
    payload     bytea       NOT NULL,
    headers     jsonb       NOT NULL DEFAULT '{}',
    created_at  timestamptz,
    lsn         pg_lsn      NOT NULL,
    attempts    integer     NOT NULL,
    last_error  text,
    dead_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS {{.DeadIndex}} ON {{.Dead}} (dead_at);
