-- idem: processed_events partitioned by day of expires_at (UTC). A unique
-- index cannot span partitions, so claims serialize per key with a
-- transaction-scoped advisory lock; the primary key includes part_day.
-- Cleanup drops the partitions of past days.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    scope        text        NOT NULL,
    id           text        NOT NULL,
    fingerprint  bytea,
    state        smallint    NOT NULL,
    token        text,
    lease_until  timestamptz,
    result       bytea,
    created_at   timestamptz NOT NULL,
    completed_at timestamptz,
    expires_at   timestamptz NOT NULL,
    part_day     date        NOT NULL,
    PRIMARY KEY (scope, id, part_day),
    CHECK (state IN (1, 2))
) PARTITION BY RANGE (part_day);
CREATE TABLE IF NOT EXISTS {{.Partition "default"}} PARTITION OF {{.Table}} DEFAULT;
CREATE INDEX IF NOT EXISTS {{.Index "expires_at"}} ON {{.Table}} (expires_at);
