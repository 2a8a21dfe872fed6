-- idem: processed_events on MySQL and MariaDB (InnoDB, whose row locks make
-- a concurrent duplicate wait), one row per key. expires_at is UTC, from
-- the database clock (UTC_TIMESTAMP). digest is the key's digest: the first
-- 16 bytes of SHA-256(scope || 0x00 || id). A row with a token is in flight
-- (lease mode) and its lease ends at expires_at; a row without one is done
-- and kept until expires_at. fingerprint and result are NULL when the key
-- has none; scope and id are NULL unless the store keeps them
-- (Options.KeepKeys).
CREATE TABLE IF NOT EXISTS {{.Table}} (
    digest      BINARY(16)  NOT NULL,
    expires_at  DATETIME(6) NOT NULL,
    fingerprint VARBINARY(32),
    token       VARCHAR(32) CHARACTER SET ascii COLLATE ascii_bin,
    result      LONGBLOB,
    scope       BLOB,
    id          BLOB,
    PRIMARY KEY (digest),
    KEY {{.Index "expires_at"}} (expires_at)
) ENGINE = InnoDB;
