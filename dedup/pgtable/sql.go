package pgtable

import "strings"

// statements are built once per store from the quoted table name. Every
// parameter is bound; only the validated, quoted table name and the table's
// lock seed (an integer) are spliced in.
type statements struct {
	claimTx, lookup, setResult                  string
	lock, insertDone, deleteExpired             string
	claimBatchSorted, claimBatchLookup          string
	leaseClaim, leaseExtend, leaseComplete      string
	leaseRelease, cleanup, backdateForTestsOnly string
}

// lockSQL is the statement Process of the plain layout runs first in its
// transaction: pg_advisory_xact_lock in its two-int4 form, on the two halves
// of the key's 64-bit hash (keyHashSQL). The two-key form has a lock space
// of its own, apart from the single-bigint locks of migration tools, of
// applications, of the partitioned layout and of idem's outbox, so it cannot
// make them wait. scope and id are text expressions.
func lockSQL(scope, id string, seed int64) string {
	return "SELECT pg_advisory_xact_lock((k.h >> 32)::int4, ((k.h << 32) >> 32)::int4) FROM (SELECT " +
		keyHashSQL(scope, id, seed) + " AS h) AS k"
}

// expiredRow is true for a row that no longer counts: a lease that ran out,
// or a row past its retention (not yet deleted by cleanup).
const expiredRow = `((e.state = 1 AND e.lease_until <= clock_timestamp()) OR e.expires_at <= clock_timestamp())`

func buildStatements(table string, seed int64) statements {
	r := strings.NewReplacer("{{T}}", table, "{{EXPIRED}}", expiredRow)
	return statements{
		// $1 scope, $2 id.
		lock: lockSQL("$1::text", "$2::text", seed),

		// $1 scope, $2 id, $3 fingerprint, $4 retention ms, $5 result.
		// The row Process writes at commit, completed and with fn's
		// result. A plain INSERT: Process deletes an expired row first
		// (deleteExpired), so a unique_violation means that a claim which
		// does not take the key's lock holds the key.
		insertDone: r.Replace(`
INSERT INTO {{T}} (scope, id, fingerprint, state, result, created_at, completed_at, expires_at)
VALUES ($1, $2, $3, 2, $5, now(), clock_timestamp(), clock_timestamp() + $4 * interval '1 millisecond')`),

		// $1 scope, $2 id. Deletes the key's row if it is expired
		// (Process, under the key's lock, before insertDone).
		deleteExpired: r.Replace(`DELETE FROM {{T}} e WHERE e.scope = $1 AND e.id = $2 AND {{EXPIRED}}`),

		// $1 scope, $2 id, $3 fingerprint, $4 retention ms.
		// One round trip: the insert wins, or the existing row is read.
		// When the insert waited for a concurrent transaction that then
		// committed, the row is not in this statement's snapshot and no
		// row comes back; the caller then runs lookup.
		claimTx: r.Replace(`
WITH ins AS (
    INSERT INTO {{T}} AS e (scope, id, fingerprint, state, created_at, completed_at, expires_at)
    VALUES ($1, $2, $3, 2, clock_timestamp(), clock_timestamp(), clock_timestamp() + $4 * interval '1 millisecond')
    ON CONFLICT (scope, id) DO UPDATE
        SET fingerprint = EXCLUDED.fingerprint, state = 2, token = NULL, lease_until = NULL, result = NULL,
            created_at = EXCLUDED.created_at, completed_at = EXCLUDED.completed_at, expires_at = EXCLUDED.expires_at
        WHERE {{EXPIRED}}
    RETURNING 1
)
SELECT true, NULL::smallint, NULL::bytea, NULL::bytea, NULL::bigint FROM ins
UNION ALL
SELECT false, e.state, e.fingerprint, e.result,
       GREATEST(0, (extract(epoch FROM (e.lease_until - clock_timestamp())) * 1000)::bigint)
FROM {{T}} e WHERE e.scope = $1 AND e.id = $2 AND NOT EXISTS (SELECT 1 FROM ins)`),

		lookup: r.Replace(`
SELECT e.state, e.fingerprint, e.result,
       GREATEST(0, (extract(epoch FROM (e.lease_until - clock_timestamp())) * 1000)::bigint),
       {{EXPIRED}}
FROM {{T}} e WHERE e.scope = $1 AND e.id = $2`),

		setResult: r.Replace(`UPDATE {{T}} SET result = $3 WHERE scope = $1 AND id = $2 AND state = 2`),

		// $1 scopes, $2 ids, $3 fingerprints, $4 retention ms: distinct
		// keys, sorted in Go, inserted in that order (so overlapping
		// batches lock keys in the same order and cannot deadlock).
		// Returns the keys that won.
		claimBatchSorted: r.Replace(`
INSERT INTO {{T}} AS e (scope, id, fingerprint, state, created_at, completed_at, expires_at)
SELECT u.scope, u.id, u.fp, 2, clock_timestamp(), clock_timestamp(), clock_timestamp() + $4 * interval '1 millisecond'
FROM unnest($1::text[], $2::text[], $3::bytea[]) AS u(scope, id, fp)
ON CONFLICT (scope, id) DO UPDATE
    SET fingerprint = EXCLUDED.fingerprint, state = 2, token = NULL, lease_until = NULL, result = NULL,
        created_at = EXCLUDED.created_at, completed_at = EXCLUDED.completed_at, expires_at = EXCLUDED.expires_at
    WHERE {{EXPIRED}}
RETURNING e.scope, e.id`),

		claimBatchLookup: r.Replace(`
SELECT e.scope, e.id, e.state, e.fingerprint, e.result,
       GREATEST(0, (extract(epoch FROM (e.lease_until - clock_timestamp())) * 1000)::bigint)
FROM {{T}} e
JOIN unnest($1::text[], $2::text[]) AS u(scope, id) ON e.scope = u.scope AND e.id = u.id`),

		// $1 scope, $2 id, $3 fingerprint, $4 token, $5 lease ms.
		leaseClaim: r.Replace(`
WITH ins AS (
    INSERT INTO {{T}} AS e (scope, id, fingerprint, state, token, lease_until, created_at, expires_at)
    VALUES ($1, $2, $3, 1, $4, clock_timestamp() + $5 * interval '1 millisecond', clock_timestamp(),
            clock_timestamp() + $5 * interval '1 millisecond')
    ON CONFLICT (scope, id) DO UPDATE
        SET fingerprint = EXCLUDED.fingerprint, state = 1, token = EXCLUDED.token, lease_until = EXCLUDED.lease_until,
            result = NULL, created_at = EXCLUDED.created_at, completed_at = NULL, expires_at = EXCLUDED.expires_at
        WHERE {{EXPIRED}}
    RETURNING 1
)
SELECT true, NULL::smallint, NULL::bytea, NULL::bytea, NULL::bigint FROM ins
UNION ALL
SELECT false, e.state, e.fingerprint, e.result,
       GREATEST(0, (extract(epoch FROM (e.lease_until - clock_timestamp())) * 1000)::bigint)
FROM {{T}} e WHERE e.scope = $1 AND e.id = $2 AND NOT EXISTS (SELECT 1 FROM ins)`),

		// $1 scope, $2 id, $3 token, $4 lease ms.
		leaseExtend: r.Replace(`
UPDATE {{T}} e SET lease_until = clock_timestamp() + $4 * interval '1 millisecond',
                   expires_at = clock_timestamp() + $4 * interval '1 millisecond'
WHERE e.scope = $1 AND e.id = $2 AND e.state = 1 AND e.token = $3 AND e.lease_until > clock_timestamp()`),

		// $1 scope, $2 id, $3 token, $4 retention ms, $5 result.
		leaseComplete: r.Replace(`
UPDATE {{T}} e SET state = 2, token = NULL, lease_until = NULL, result = $5, completed_at = clock_timestamp(),
                   expires_at = clock_timestamp() + $4 * interval '1 millisecond'
WHERE e.scope = $1 AND e.id = $2 AND e.state = 1 AND e.token = $3 AND e.lease_until > clock_timestamp()`),

		leaseRelease: r.Replace(`
DELETE FROM {{T}} e
WHERE e.scope = $1 AND e.id = $2 AND e.state = 1 AND e.token = $3 AND e.lease_until > clock_timestamp()`),

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
