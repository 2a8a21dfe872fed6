-- idem: processed_events on PostgreSQL, one row per key. Every time in it
-- comes from the database clock. digest is the key's digest: the first 16
-- bytes of SHA-256(scope || 0x00 || id). A row with a token is in flight
-- (lease mode) and its lease ends at expires_at; a row without one is done
-- and kept until expires_at. fingerprint and result are NULL when the key
-- has none; scope and id are NULL unless the store keeps them
-- (Options.KeepKeys).
CREATE TABLE IF NOT EXISTS {{.Table}} (
    digest      bytea       NOT NULL,
    expires_at  timestamptz NOT NULL,
    fingerprint bytea,
    token       text,
    result      bytea,
    scope       text,
    id          text,
    PRIMARY KEY (digest)
);
CREATE INDEX IF NOT EXISTS {{.Index "expires_at"}} ON {{.Table}} (expires_at);
