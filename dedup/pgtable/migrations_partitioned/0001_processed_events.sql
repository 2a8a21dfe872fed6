-- idem: processed_events partitioned by the UTC day (part_day) or hour
-- (part_hour) of expires_at. A unique index cannot span partitions, so
-- claims serialize per key with a transaction-scoped advisory lock; the
-- primary key includes the partition key. There is no default partition:
-- old partitions are detached concurrently, which a default partition
-- forbids. The store creates partitions ahead and drops the past ones.
-- The columns are those of the plain layout (key is the key's digest, a
-- row with a token is in flight), with the partition key after the
-- fixed-size ones.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    key         uuid        NOT NULL,
    expires_at  timestamptz NOT NULL,
    {{.PartColumn}} {{.PartType}} NOT NULL,
    fingerprint bytea,
    token       text,
    result      bytea,
    scope       text,
    id          text,
    PRIMARY KEY (key, {{.PartColumn}})
) PARTITION BY RANGE ({{.PartColumn}});
CREATE INDEX IF NOT EXISTS {{.Index "expires_at"}} ON {{.Table}} (expires_at);
