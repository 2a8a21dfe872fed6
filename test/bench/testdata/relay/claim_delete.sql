-- One batch of the poll relay (pgoutbox.Relay, BatchSize 500, ScanWindow
-- 2000, PerKeyBatch 1, one session owning all 16 shards): BEGIN and the
-- claim in one round trip, then the delete (RelayOptions.DeletePublished) and COMMIT in another, as the
-- relay sends them. The claim is pgoutbox's own (outbox/pgoutbox/sql.go).
-- See setup.sql.
BEGIN;
SELECT array_agg(seq) AS seqs FROM (
WITH now AS MATERIALIZED (SELECT clock_timestamp() AS t),
blocked AS MATERIALIZED (
    SELECT DISTINCT b.key FROM relay_floor.outbox b, now
    WHERE b.state = 0 AND b.attempts > 0 AND b.available_at > now.t AND b.key <> ''::bytea
      AND b.key_hash % 16 = ANY ('{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}'::integer[])
),
win AS MATERIALIZED (
    SELECT w.seq, w.key FROM relay_floor.outbox w, now
    WHERE w.state = 0 AND w.key_hash % 16 = ANY ('{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}'::integer[])
      AND (w.attempts = 0 OR w.available_at <= now.t)
      AND (w.key = ''::bytea OR NOT EXISTS (SELECT 1 FROM blocked x WHERE x.key = w.key))
    ORDER BY w.seq LIMIT 2000
),
cand AS MATERIALIZED (
    SELECT r.seq, r.key FROM (
        SELECT seq, key, row_number() OVER (PARTITION BY key ORDER BY seq) AS rn FROM win
    ) r
    WHERE r.key = ''::bytea OR r.rn <= 1
),
locked AS MATERIALIZED (
    SELECT o.seq, o.key, o.id, o.topic, o.payload, o.headers, o.created_at, o.attempts, o.available_at
    FROM relay_floor.outbox o
    WHERE o.seq IN (SELECT seq FROM cand) AND o.state = 0
    ORDER BY o.seq LIMIT 500
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
DELETE FROM relay_floor.outbox WHERE seq = ANY (:seqs::bigint[]) AND state = 0;
COMMIT;
