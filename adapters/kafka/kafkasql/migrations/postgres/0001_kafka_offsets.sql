-- idem kafkasql: a consumer group's positions on PostgreSQL, one row per
-- partition. next_offset is the offset the group resumes from: every record
-- before it is done. It only moves forward.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    group_id     text        NOT NULL,
    topic        text        NOT NULL,
    partition_id integer     NOT NULL,
    next_offset  bigint      NOT NULL,
    updated_at   timestamptz NOT NULL,
    PRIMARY KEY (group_id, topic, partition_id)
);
