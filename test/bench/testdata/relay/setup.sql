-- The poll relay's SQL floor: an outbox table in pgoutbox's layout (as
-- `idem migrate up` creates it) holding 200,000 pending rows on 1,000 keys,
-- 16 shards, each row's payload 100 bytes, as the relay rows of make bench
-- enqueue them. claim_mark.sql then drains it 500 rows per transaction.
--
--   psql -f test/bench/testdata/relay/setup.sql
--   pgbench -n -M prepared -c 1 -t 400 -f test/bench/testdata/relay/claim_mark.sql
--   pgbench -n -M prepared -c 1 -t 400 -f test/bench/testdata/relay/claim_delete.sql  (after setup.sql again)
DROP SCHEMA IF EXISTS relay_floor CASCADE;
CREATE SCHEMA relay_floor;
CREATE TABLE relay_floor.outbox (
    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id uuid NOT NULL UNIQUE,
    topic text NOT NULL,
    key bytea NOT NULL,
    key_hash integer NOT NULL CHECK (key_hash >= 0),
    payload bytea NOT NULL,
    headers jsonb NOT NULL DEFAULT '{}'::jsonb,
    state smallint NOT NULL DEFAULT 0 CHECK (state IN (0, 1, 2)),
    attempts integer NOT NULL DEFAULT 0,
    last_error text,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    available_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    published_at timestamptz,
    dead_at timestamptz
);
CREATE INDEX ON relay_floor.outbox (seq) WHERE state = 0;
CREATE INDEX ON relay_floor.outbox (available_at) WHERE state = 0 AND attempts > 0;
CREATE INDEX ON relay_floor.outbox (published_at) WHERE state = 1;
CREATE INDEX ON relay_floor.outbox (dead_at) WHERE state = 2;
INSERT INTO relay_floor.outbox (id, topic, key, key_hash, payload, headers)
SELECT gen_random_uuid(), 'orders', convert_to('key-' || (i % 1000), 'UTF8'), (i % 1000) % 16,
       convert_to(repeat('x', 100), 'UTF8'), '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}'
FROM generate_series(1, 200000) AS i;
VACUUM ANALYZE relay_floor.outbox;
