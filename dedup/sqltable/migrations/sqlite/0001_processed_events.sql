-- idem: processed_events on SQLite, one row per key. expires_at is Unix
-- time in milliseconds, from the database clock (julianday('now')). digest
-- is the key's digest: the first 16 bytes of SHA-256(scope || 0x00 || id).
-- A row with a token is in flight (lease mode) and its lease ends at
-- expires_at; a row without one is done and kept until expires_at.
-- fingerprint and result are NULL when the key has none; scope and id are
-- NULL unless the store keeps them (Options.KeepKeys).
CREATE TABLE IF NOT EXISTS {{.Table}} (
    digest      BLOB    NOT NULL,
    expires_at  INTEGER NOT NULL,
    fingerprint BLOB,
    token       TEXT,
    result      BLOB,
    scope       TEXT,
    id          TEXT,
    PRIMARY KEY (digest)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS {{.SchemaIndex "expires_at"}} ON {{.BareTable}} (expires_at);
