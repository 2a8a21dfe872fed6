-- idem kafkasql: a consumer group's positions on MySQL and MariaDB, one row
-- per partition. next_offset is the offset the group resumes from: every
-- record before it is done. It only moves forward. Group and topic names
-- compare byte for byte (utf8mb4_bin), as Kafka compares them. updated_at
-- is UTC, from the database clock.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    group_id     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    topic        VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    partition_id INT         NOT NULL,
    next_offset  BIGINT      NOT NULL,
    updated_at   DATETIME(6) NOT NULL,
    PRIMARY KEY (group_id, topic, partition_id)
) ENGINE = InnoDB;
