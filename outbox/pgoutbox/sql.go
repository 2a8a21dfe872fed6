package pgoutbox

import "strings"

// statements are built once per outbox from the quoted table name. Every
// parameter is bound; only the validated, quoted table name is spliced in.
type statements struct {
	lockKeys, insert, notify                  string
	claim, nextDue, markPublished, markDelete string
	markFailed                                string
	cleanup, cleanupDead, backlog             string
	requeueDead, deadPage, deleteDead         string
}

func buildStatements(table string) statements {
	r := strings.NewReplacer("{{T}}", table)
	return statements{
		// $1 the keys' lock ids. Sorted, so two Enqueue calls that lock
		// the same keys lock them in the same order.
		lockKeys: `SELECT count(pg_advisory_xact_lock(s.k)) FROM (SELECT DISTINCT unnest($1::bigint[]) AS k ORDER BY 1) s`,

		// One row per message, inserted in input order so that the
		// messages of one call get their seq in the order given.
		insert: r.Replace(`
INSERT INTO {{T}} (id, topic, key, key_hash, payload, headers)
SELECT u.id, u.topic, u.key, u.key_hash, u.payload, u.headers::jsonb
FROM unnest($1::uuid[], $2::text[], $3::bytea[], $4::integer[], $5::bytea[], $6::text[])
     WITH ORDINALITY AS u(id, topic, key, key_hash, payload, headers, ord)
ORDER BY u.ord`),

		// Delivered at commit; PostgreSQL folds the repeats of one
		// transaction into one notification.
		notify: `SELECT pg_notify($1, '')`,

		// $1 shard count, $2 owned shards, $3 scan window, $4 messages per
		// key, $5 batch size.
		//
		// blocked: keys whose head waits for a retry. Such a key is left
		// out entirely, so its later messages wait behind it.
		// win: the oldest $3 claimable rows of the owned shards. A key not
		// blocked has every pending row claimable, so its rows in win are
		// its oldest pending rows.
		// cand: at most $4 rows per key (keyless rows are unordered).
		// locked: the oldest $5 of cand that can be locked, skipping rows
		// another transaction holds (another session's, or this session's
		// batch still being published); state = 0 is rechecked on the
		// latest row version, so a row published meanwhile is skipped too.
		// The result is every locked row and every candidate before the
		// last locked one that was skipped, in seq order (no join: the
		// generic plan's row estimates would make it a nested loop); the
		// caller drops every row of a key from the first one not locked.
		// The last column is a locked row's age in microseconds since it
		// became available (its insert, or its retry falling due), for the
		// idem.outbox.delay metric.
		claim: r.Replace(`
WITH now AS MATERIALIZED (SELECT clock_timestamp() AS t),
blocked AS MATERIALIZED (
    SELECT DISTINCT b.key FROM {{T}} b, now
    WHERE b.state = 0 AND b.attempts > 0 AND b.available_at > now.t AND b.key <> ''::bytea
      AND b.key_hash % $1 = ANY ($2::integer[])
),
win AS MATERIALIZED (
    SELECT w.seq, w.key FROM {{T}} w, now
    WHERE w.state = 0 AND w.key_hash % $1 = ANY ($2::integer[])
      AND (w.attempts = 0 OR w.available_at <= now.t)
      AND (w.key = ''::bytea OR NOT EXISTS (SELECT 1 FROM blocked x WHERE x.key = w.key))
    ORDER BY w.seq LIMIT $3
),
cand AS MATERIALIZED (
    SELECT r.seq, r.key FROM (
        SELECT seq, key, row_number() OVER (PARTITION BY key ORDER BY seq) AS rn FROM win
    ) r
    WHERE r.key = ''::bytea OR r.rn <= $4
),
locked AS MATERIALIZED (
    SELECT o.seq, o.key, o.id, o.topic, o.payload, o.headers, o.created_at, o.attempts, o.available_at
    FROM {{T}} o
    WHERE o.seq IN (SELECT seq FROM cand) AND o.state = 0
    ORDER BY o.seq LIMIT $5
    FOR UPDATE SKIP LOCKED
)
SELECT l.seq, l.key, true, l.id::text, l.topic, l.payload, l.headers::text, l.created_at, l.attempts,
       (extract(epoch FROM ((SELECT t FROM now) - l.available_at)) * 1000000)::bigint
FROM locked l
UNION ALL
SELECT c.seq, c.key, false, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM cand c
WHERE c.seq < (SELECT max(seq) FROM locked) AND c.seq NOT IN (SELECT seq FROM locked)
ORDER BY 1`),

		// Milliseconds until the next retry in the owned shards is due,
		// NULL when none waits.
		nextDue: r.Replace(`
SELECT (extract(epoch FROM (min(available_at) - clock_timestamp())) * 1000)::bigint
FROM {{T}} WHERE state = 0 AND attempts > 0 AND available_at > clock_timestamp()
  AND key_hash % $1 = ANY ($2::integer[])`),

		markPublished: r.Replace(`
UPDATE {{T}} SET state = 1, published_at = clock_timestamp(), attempts = attempts + 1, last_error = NULL
WHERE seq = ANY ($1::bigint[]) AND state = 0`),

		markDelete: r.Replace(`DELETE FROM {{T}} WHERE seq = ANY ($1::bigint[]) AND state = 0`),

		// $1 seqs, $2 errors, $3 delays in ms, $4 dead flags.
		markFailed: r.Replace(`
UPDATE {{T}} o SET attempts = o.attempts + 1, last_error = f.err,
    available_at = clock_timestamp() + f.delay_ms * interval '1 millisecond',
    state = CASE WHEN f.dead THEN 2 ELSE 0 END,
    dead_at = CASE WHEN f.dead THEN clock_timestamp() END
FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::boolean[]) AS f(seq, err, delay_ms, dead)
WHERE o.seq = f.seq AND o.state = 0`),

		// $1 retention in ms, $2 batch size.
		cleanup: r.Replace(`
DELETE FROM {{T}} WHERE seq = ANY (ARRAY(
    SELECT e.seq FROM {{T}} e
    WHERE e.state = 1 AND e.published_at <= clock_timestamp() - $1 * interval '1 millisecond'
    ORDER BY e.published_at LIMIT $2 FOR UPDATE SKIP LOCKED))`),

		cleanupDead: r.Replace(`
DELETE FROM {{T}} WHERE seq = ANY (ARRAY(
    SELECT e.seq FROM {{T}} e
    WHERE e.state = 2 AND e.dead_at <= clock_timestamp() - $1 * interval '1 millisecond'
    ORDER BY e.dead_at LIMIT $2 FOR UPDATE SKIP LOCKED))`),

		backlog: r.Replace(`
SELECT count(*), coalesce((extract(epoch FROM (clock_timestamp() - min(created_at))) * 1000)::bigint, 0)
FROM {{T}} WHERE state = 0`),

		// $1, $2 the dead_at and seq of the last row of the previous
		// page, $3 the page size. A range scan of the dead-row index.
		deadPage: r.Replace(`
SELECT seq, id::text, topic, key, payload, headers, attempts, coalesce(last_error, ''), created_at, dead_at
FROM {{T}} WHERE state = 2 AND dead_at >= $1 AND (dead_at, seq) > ($1, $2)
ORDER BY dead_at, seq LIMIT $3`),

		deleteDead: r.Replace(`DELETE FROM {{T}} WHERE id = ANY ($1::uuid[]) AND state = 2`),

		requeueDead: r.Replace(`
UPDATE {{T}} SET state = 0, attempts = 0, last_error = NULL, dead_at = NULL, available_at = clock_timestamp()
WHERE id = ANY ($1::uuid[]) AND state = 2`),
	}
}
