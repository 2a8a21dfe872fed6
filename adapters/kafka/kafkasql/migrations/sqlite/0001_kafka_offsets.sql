-- idem kafkasql: a consumer group's positions on SQLite, one row per
-- partition. next_offset is the offset the group resumes from: every record
-- before it is done. It only moves forward. updated_at is UTC text
-- (ISO 8601).
CREATE TABLE IF NOT EXISTS {{.Table}} (
    group_id     TEXT    NOT NULL,
    topic        TEXT    NOT NULL,
    partition_id INTEGER NOT NULL,
    next_offset  INTEGER NOT NULL,
    updated_at   TEXT    NOT NULL,
    PRIMARY KEY (group_id, topic, partition_id)
);
