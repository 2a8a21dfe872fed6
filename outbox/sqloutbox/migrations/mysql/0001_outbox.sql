-- idem outbox on MySQL 8 / MariaDB 10.6+. One row per outgoing message;
-- every time in it is UTC from the database clock. state 0 = pending,
-- 1 = published, 2 = dead.
--
-- seq orders the rows. Enqueue locks the message key's slot row in the
-- keys table before inserting, so two rows of one key get their seq in
-- commit order. key_hash is 0 for a keyless message (no order) and a
-- positive hash of the key otherwise.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    seq          BIGINT      NOT NULL AUTO_INCREMENT,
    id           CHAR(36)    CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    topic        TEXT        CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    msg_key      BLOB        NOT NULL,
    key_hash     BIGINT      NOT NULL,
    payload      LONGBLOB    NOT NULL,
    headers      LONGTEXT    CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    state        TINYINT     NOT NULL DEFAULT 0,
    attempts     INT         NOT NULL DEFAULT 0,
    last_error   TEXT        CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    created_at   DATETIME(6) NOT NULL,
    available_at DATETIME(6) NOT NULL,
    published_at DATETIME(6) NULL,
    dead_at      DATETIME(6) NULL,
    PRIMARY KEY (seq),
    UNIQUE KEY {{.Index "id"}} (id),
    -- The relay scans pending rows in seq order.
    KEY {{.Index "pending"}} (state, seq),
    -- A key's earlier pending rows.
    KEY {{.Index "key"}} (key_hash, state, seq),
    -- Retention of published and dead rows.
    KEY {{.Index "published"}} (state, published_at),
    KEY {{.Index "dead"}} (state, dead_at)
) ENGINE = InnoDB;

-- One row per key slot (4096). Enqueue locks the slots of its keys with
-- SELECT ... FOR UPDATE until its transaction ends; the rows never change.
CREATE TABLE IF NOT EXISTS {{.KeyTable}} (
    slot INT NOT NULL,
    PRIMARY KEY (slot)
) ENGINE = InnoDB;

INSERT IGNORE INTO {{.KeyTable}} (slot)
SELECT a.d * 256 + b.d * 16 + c.d
FROM (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5
      UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9 UNION ALL SELECT 10 UNION ALL SELECT 11
      UNION ALL SELECT 12 UNION ALL SELECT 13 UNION ALL SELECT 14 UNION ALL SELECT 15) a
CROSS JOIN (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5
      UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9 UNION ALL SELECT 10 UNION ALL SELECT 11
      UNION ALL SELECT 12 UNION ALL SELECT 13 UNION ALL SELECT 14 UNION ALL SELECT 15) b
CROSS JOIN (SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5
      UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9 UNION ALL SELECT 10 UNION ALL SELECT 11
      UNION ALL SELECT 12 UNION ALL SELECT 13 UNION ALL SELECT 14 UNION ALL SELECT 15) c;
