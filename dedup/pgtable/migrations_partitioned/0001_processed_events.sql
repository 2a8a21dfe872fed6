-- idem: processed_events partitioned by the UTC day (part_day) or hour
-- (part_hour) of expires_at. A unique index cannot span partitions, so
-- claims serialize per key with a transaction-scoped advisory lock; the
-- primary key includes the partition key. There is no default partition:
-- old partitions are detached concurrently, which a default partition
-- forbids. The store creates partitions ahead and drops the past ones.
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
    {{.PartColumn}} {{.PartType}} NOT NULL,
    PRIMARY KEY (scope, id, {{.PartColumn}}),
    CHECK (state IN (1, 2))
) PARTITION BY RANGE ({{.PartColumn}});
CREATE INDEX IF NOT EXISTS {{.Index "expires_at"}} ON {{.Table}} (expires_at);
