-- One batch of the poll relay (pgoutbox.Relay with BatchSize 500,
-- ScanWindow 2000, PerKeyBatch 1 and one session owning all 16 shards), its
-- statements as the relay sends them: BEGIN and the claim in one round
-- trip, then the mark (or, with -D delete=1, the delete of
-- RelayOptions.DeletePublished) and COMMIT in another. The statements are
-- pgoutbox's own on the table relay_floor.outbox, their parameters bound
-- from the variables below (TestFloorScriptSendsRelayStatements in
-- outbox/pgoutbox checks that they are). See setup.sql.
\set shards 16
\set window 2000
\set perkey 1
\set batch 500
BEGIN;
SELECT array_agg(seq) AS seqs FROM (
WITH now AS MATERIALIZED (SELECT clock_timestamp() AS t),
blocked AS MATERIALIZED (
    SELECT DISTINCT b.key FROM relay_floor.outbox b, now
    WHERE b.state = 0 AND b.attempts > 0 AND b.available_at > now.t AND b.key <> ''::bytea
      AND b.key_hash % :shards = ANY (:owned::integer[])
),
win AS MATERIALIZED (
    SELECT w.seq, w.key FROM relay_floor.outbox w, now
    WHERE w.state = 0 AND w.key_hash % :shards = ANY (:owned::integer[])
      AND (w.attempts = 0 OR w.available_at <= now.t)
      AND (w.key = ''::bytea OR NOT EXISTS (SELECT 1 FROM blocked x WHERE x.key = w.key))
    ORDER BY w.seq LIMIT :window
),
cand AS MATERIALIZED (
    SELECT r.seq, r.key FROM (
        SELECT seq, key, row_number() OVER (PARTITION BY key ORDER BY seq) AS rn FROM win
    ) r
    WHERE r.key = ''::bytea OR r.rn <= :perkey
),
locked AS MATERIALIZED (
    SELECT o.seq, o.key, o.id, o.topic, o.payload, o.headers, o.created_at, o.attempts, o.available_at
    FROM relay_floor.outbox o
    WHERE o.seq IN (SELECT seq FROM cand) AND o.state = 0
    ORDER BY o.seq LIMIT :batch
    FOR UPDATE SKIP LOCKED
)
SELECT l.seq, l.key, true, l.id::text, l.topic, l.payload, l.headers::text, l.created_at, l.attempts,
       (extract(epoch FROM ((SELECT t FROM now) - l.available_at)) * 1000000)::bigint
FROM locked l
UNION ALL
SELECT c.seq, c.key, false, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM cand c
WHERE c.seq < (SELECT max(seq) FROM locked) AND c.seq NOT IN (SELECT seq FROM locked)
ORDER BY 1
) c (seq, key, locked, id, topic, payload, headers, created_at, attempts, age) WHERE locked \gset
\if :delete
DELETE FROM relay_floor.outbox WHERE seq = ANY (:seqs::bigint[]) AND state = 0;
\else
UPDATE relay_floor.outbox SET state = 1, published_at = clock_timestamp(), attempts = attempts + 1, last_error = NULL
WHERE seq = ANY (:seqs::bigint[]) AND state = 0;
\endif
COMMIT;
