package pgtable

import "strings"

// statements are built once per store from the quoted table name. Every
// parameter is bound; only the validated, quoted table name is spliced in.
//
// A key's row is found by its digest (keyDigest, a uuid parameter). A row
// with a token is in flight (lease mode) until expires_at; a row without
// one is done. Statements return the row's state as 1 (in flight) or 2
// (done), and the time left of an in-flight row's lease in milliseconds.
type statements struct {
	claimFirst, claimTx, lookup, setResult      string
	claimBatchSorted, claimBatchLookup          string
	claimBatchPlain                             string
	leaseClaim, leaseExtend, leaseComplete      string
	leaseRelease, cleanup, backdateForTestsOnly string
	inspect                                     string
}

// expiredRow is true for a row that no longer counts: a lease that ran out,
// or a row past its retention (not yet deleted by cleanup). An in-flight
// row expires when its lease ends.
const expiredRow = `(e.expires_at <= clock_timestamp())`

// stateSQL is the state of row e: 1 in flight, 2 done.
const stateSQL = `CASE WHEN e.token IS NULL THEN 2 ELSE 1 END::smallint`

// leaseMsSQL is the time left of row e's lease in milliseconds; NULL for a
// done row.
const leaseMsSQL = `CASE WHEN e.token IS NOT NULL
    THEN GREATEST(0, (extract(epoch FROM (e.expires_at - clock_timestamp())) * 1000)::bigint) END`

func buildStatements(table string) statements {
	r := strings.NewReplacer("{{T}}", table, "{{EXPIRED}}", expiredRow, "{{STATE}}", stateSQL, "{{LEASE}}", leaseMsSQL)
	return statements{
		// $1 key, $2 fingerprint, $3 retention ms, $4 scope, $5 id.
		// Process's claim: the key's row, completed, or nothing when the
		// key has a row (expired or not; the caller then runs claimTx).
		// A concurrent insert of the key makes it wait until that
		// transaction ends.
		claimFirst: r.Replace(`
INSERT INTO {{T}} (key, expires_at, fingerprint, scope, id)
VALUES ($1, clock_timestamp() + $3 * interval '1 millisecond', $2, $4, $5)
ON CONFLICT (key) DO NOTHING`),

		// $1 key, $2 fingerprint, $3 retention ms, $4 scope, $5 id.
		// One round trip: the insert wins, or the existing row is read.
		// When the insert waited for a concurrent transaction that then
		// committed, this statement's snapshot holds the row as it was
		// before: absent, or an expired row the other transaction took
		// over (which the conflict's WHERE, checked on the newest row,
		// did not). No row comes back then; the caller runs lookup, whose
		// snapshot has the other transaction's row.
		claimTx: r.Replace(`
WITH ins AS (
    INSERT INTO {{T}} AS e (key, expires_at, fingerprint, scope, id)
    VALUES ($1, clock_timestamp() + $3 * interval '1 millisecond', $2, $4, $5)
    ON CONFLICT (key) DO UPDATE
        SET expires_at = EXCLUDED.expires_at, fingerprint = EXCLUDED.fingerprint, token = NULL, result = NULL,
            scope = EXCLUDED.scope, id = EXCLUDED.id
        WHERE {{EXPIRED}}
    RETURNING 1
)
SELECT true, NULL::smallint, NULL::bytea, NULL::bytea, NULL::bigint FROM ins
UNION ALL
SELECT false, {{STATE}}, e.fingerprint, e.result, {{LEASE}}
FROM {{T}} e WHERE e.key = $1 AND NOT {{EXPIRED}} AND NOT EXISTS (SELECT 1 FROM ins)`),

		// $1 key.
		lookup: r.Replace(`
SELECT {{STATE}}, e.fingerprint, e.result, {{LEASE}}, {{EXPIRED}}
FROM {{T}} e WHERE e.key = $1`),

		// $1 key. Inspect: the row whatever its state, with the time it
		// expires and whether that has passed. In the partitioned layout a
		// key has at most one row (a claim deletes an expired row before
		// it inserts); the newest wins all the same.
		inspect: r.Replace(`
SELECT e.token IS NOT NULL, e.expires_at, {{EXPIRED}}, e.fingerprint, e.result, e.scope, e.id
FROM {{T}} e WHERE e.key = $1 ORDER BY e.expires_at DESC LIMIT 1`),

		// $1 key, $2 result.
		setResult: r.Replace(`UPDATE {{T}} SET result = $2 WHERE key = $1 AND token IS NULL`),

		// $1 keys, $2 fingerprints, $3 retention ms, $4 scopes, $5 ids
		// (NULL unless kept): distinct keys, sorted in Go, inserted in
		// that order (so overlapping batches lock keys in the same order
		// and cannot deadlock). Returns the keys that won.
		claimBatchSorted: r.Replace(`
INSERT INTO {{T}} AS e (key, expires_at, fingerprint, scope, id)
SELECT u.key, clock_timestamp() + $3 * interval '1 millisecond', u.fp, u.scope, u.id
FROM unnest($1::uuid[], $2::bytea[], $4::text[], $5::text[]) AS u(key, fp, scope, id)
ON CONFLICT (key) DO UPDATE
    SET expires_at = EXCLUDED.expires_at, fingerprint = EXCLUDED.fingerprint, token = NULL, result = NULL,
        scope = EXCLUDED.scope, id = EXCLUDED.id
    WHERE {{EXPIRED}}
RETURNING e.key`),

		// $1 keys, $2 fingerprints, $3 retention ms, $4 scopes, $5 ids
		// (NULL unless kept): distinct keys, sorted in Go, inserted in
		// that order, with no conflict clause: one row a key and its index
		// entries, nothing sent back. A key that has a row (live or
		// expired), or that a concurrent transaction inserted, fails the
		// whole statement with a unique violation, after waiting for that
		// transaction to end (BeginBatch then claims the batch with
		// claimBatchSorted in a new transaction).
		claimBatchPlain: r.Replace(`
INSERT INTO {{T}} (key, expires_at, fingerprint, scope, id)
SELECT u.key, clock_timestamp() + $3 * interval '1 millisecond', u.fp, u.scope, u.id
FROM unnest($1::uuid[], $2::bytea[], $4::text[], $5::text[]) AS u(key, fp, scope, id)`),

		// $1 keys.
		claimBatchLookup: r.Replace(`
SELECT e.key, {{STATE}}, e.fingerprint, e.result, {{LEASE}}
FROM {{T}} e WHERE e.key = ANY ($1::uuid[])`),

		// $1 key, $2 fingerprint, $3 token, $4 lease ms, $5 scope, $6 id.
		leaseClaim: r.Replace(`
WITH ins AS (
    INSERT INTO {{T}} AS e (key, expires_at, fingerprint, token, scope, id)
    VALUES ($1, clock_timestamp() + $4 * interval '1 millisecond', $2, $3, $5, $6)
    ON CONFLICT (key) DO UPDATE
        SET expires_at = EXCLUDED.expires_at, fingerprint = EXCLUDED.fingerprint, token = EXCLUDED.token,
            result = NULL, scope = EXCLUDED.scope, id = EXCLUDED.id
        WHERE {{EXPIRED}}
    RETURNING 1
)
SELECT true, NULL::smallint, NULL::bytea, NULL::bytea, NULL::bigint FROM ins
UNION ALL
SELECT false, {{STATE}}, e.fingerprint, e.result, {{LEASE}}
FROM {{T}} e WHERE e.key = $1 AND NOT {{EXPIRED}} AND NOT EXISTS (SELECT 1 FROM ins)`),

		// $1 key, $2 token, $3 lease ms.
		leaseExtend: r.Replace(`
UPDATE {{T}} e SET expires_at = clock_timestamp() + $3 * interval '1 millisecond'
WHERE e.key = $1 AND e.token = $2 AND e.expires_at > clock_timestamp()`),

		// $1 key, $2 token, $3 retention ms, $4 result.
		leaseComplete: r.Replace(`
UPDATE {{T}} e SET token = NULL, result = $4, expires_at = clock_timestamp() + $3 * interval '1 millisecond'
WHERE e.key = $1 AND e.token = $2 AND e.expires_at > clock_timestamp()`),

		// $1 key, $2 token.
		leaseRelease: r.Replace(`
DELETE FROM {{T}} e
WHERE e.key = $1 AND e.token = $2 AND e.expires_at > clock_timestamp()`),

		// $1 batch size, $2 cutoff. Deletes at most $1 rows that expired
		// by $2, oldest first, skipping rows a claim holds locked. The
		// cutoff is a parameter (not clock_timestamp(), which is volatile
		// and would be evaluated per row) and the rows are taken in
		// expires_at order, so each batch is a range scan of the
		// expires_at index, not a scan of the table.
		cleanup: r.Replace(`
DELETE FROM {{T}} WHERE ctid = ANY (ARRAY(
    SELECT e.ctid FROM {{T}} e WHERE e.expires_at <= $2
    ORDER BY e.expires_at LIMIT $1 FOR UPDATE SKIP LOCKED))`),

		backdateForTestsOnly: r.Replace(`UPDATE {{T}} SET expires_at = clock_timestamp() - interval '1 second'`),
	}
}
