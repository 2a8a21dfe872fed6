-- The poll relay's SQL floor (claim.sql): an outbox table made by idem's
-- own migrations, refilled with 200,000 pending rows on 1,000 keys in 16
-- shards, each with a 100-byte payload and a traceparent header, as the
-- relay rows of make bench enqueue them. A run of claim.sql drains it 500
-- rows per transaction, so run this again before each:
--
--   idem migrate up --schema relay_floor
--   psql -f test/bench/testdata/relay/setup.sql
--   pgbench -n -M prepared -c 1 -t 400 -r -D delete=0 -D owned='{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}' -f test/bench/testdata/relay/claim.sql
--
-- and -D delete=1 for the delete of RelayOptions.DeletePublished.
TRUNCATE relay_floor.outbox;
INSERT INTO relay_floor.outbox (id, topic, key, key_hash, payload, headers)
SELECT gen_random_uuid(), 'orders', convert_to('key-' || (i % 1000), 'UTF8'), (i % 1000) % 16,
       convert_to(repeat('x', 100), 'UTF8'), '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}'
FROM generate_series(1, 200000) AS i;
VACUUM ANALYZE relay_floor.outbox;
