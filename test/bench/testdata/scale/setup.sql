-- A processed_events table of 10 million claimed keys in pgtable's layout
-- (idem_scale.big) and an empty one (idem_scale.empty), for the large-table
-- figures of docs/SCALING.md:
--
--   psql -h 127.0.0.1 -U postgres -d test -f test/bench/testdata/scale/setup.sql
--   pgbench -n -M prepared -c 8 -j 2 -T 15 -f test/bench/testdata/scale/claim_big.sql -h 127.0.0.1 -U postgres test
--   pgbench -n -M prepared -c 8 -j 2 -T 15 -f test/bench/testdata/scale/claim_empty.sql -h 127.0.0.1 -U postgres test
--   (three rounds, alternating; compare the medians)
--   psql -h 127.0.0.1 -U postgres -d test -f test/bench/testdata/scale/expire.sql
--   pgbench -n -c 1 -t 1100 -f test/bench/testdata/scale/cleanup.sql -h 127.0.0.1 -U postgres test
--   psql -h 127.0.0.1 -U postgres -d test -c 'DROP SCHEMA idem_scale CASCADE'
DROP SCHEMA IF EXISTS idem_scale CASCADE;
CREATE SCHEMA idem_scale;
CREATE TABLE idem_scale.big (key uuid NOT NULL, expires_at timestamptz NOT NULL, fingerprint bytea, token text, result bytea, scope text, id text, PRIMARY KEY (key));
CREATE INDEX ON idem_scale.big (expires_at);
CREATE TABLE idem_scale.empty (LIKE idem_scale.big INCLUDING ALL);
INSERT INTO idem_scale.big (key, expires_at)
SELECT md5('pre' || g::text)::uuid, now() + (g % 86400) * interval '1 second' FROM generate_series(1, 10000000) g;
VACUUM ANALYZE idem_scale.big;
