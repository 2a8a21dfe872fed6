package pgtable

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/sqlname"
)

// The partitioned layout (Options.Partitioned). Every claim is three
// statements sent as one pgx batch (one round trip):
//
//  1. a transaction-scoped advisory lock on the key, so claims of one key
//     serialize until the holder's transaction ends (what the primary key
//     does in the plain layout);
//  2. delete the key's expired row, if any;
//  3. insert unless a row exists, else return the row.
//
// Statement 3 starts after the lock is granted, so its snapshot sees a
// concurrent claim that committed while this one waited.

type partitionedStatements struct {
	lock, lockMany, deleteExpired, deleteExpiredMany string
	claimTx, claimBatch, leaseClaim, insertDone      string
	leaseExtend, leaseComplete                       string
	listPartitions, cleanupDefault                   string
}

// partDay is the partition key of a row expiring at expr.
func partDay(expr string) string { return "((" + expr + ") AT TIME ZONE 'UTC')::date" }

func lockSeed(name string) int64 {
	h := fnv.New64a()
	h.Write([]byte("idem:pgtable:key:" + name))
	return int64(h.Sum64())
}

// keyHashSQL is the SQL expression of a key's 64-bit lock hash: scope and id
// are text expressions, the length prefix keeps ("ab", "c") and ("a", "bc")
// apart, and seed (lockSeed of the table) keeps tables apart. Both layouts
// lock on it (see lockSQL and partitionedStatements.lock).
func keyHashSQL(scope, id string, seed int64) string {
	return fmt.Sprintf("hashtextextended(length(%s)::text || ':' || %s || %s, %d)", scope, scope, id, seed)
}

func buildPartitionedStatements(table, quotedBase string, seed int64) partitionedStatements {
	keyHash := func(scope, id string) string { return keyHashSQL(scope, id, seed) }
	r := strings.NewReplacer("{{T}}", table, "{{EXPIRED}}", expiredRow)
	exp := "clock_timestamp() + $4 * interval '1 millisecond'"
	leaseExp := "clock_timestamp() + $5 * interval '1 millisecond'"
	return partitionedStatements{
		lock: "SELECT pg_advisory_xact_lock(" + keyHash("$1::text", "$2::text") + ")",
		lockMany: "SELECT count(pg_advisory_xact_lock(h)) FROM (SELECT DISTINCT " + keyHash("u.scope", "u.id") +
			" AS h FROM unnest($1::text[], $2::text[]) AS u(scope, id) ORDER BY 1) AS k",
		deleteExpired: r.Replace(`DELETE FROM {{T}} e WHERE e.scope = $1 AND e.id = $2 AND {{EXPIRED}}`),
		deleteExpiredMany: r.Replace(`DELETE FROM {{T}} e USING unnest($1::text[], $2::text[]) AS u(scope, id)
WHERE e.scope = u.scope AND e.id = u.id AND {{EXPIRED}}`),
		// $1 scope, $2 id, $3 fingerprint, $4 retention ms.
		claimTx: r.Replace(`
WITH cur AS (
    SELECT e.state, e.fingerprint, e.result,
           GREATEST(0, (extract(epoch FROM (e.lease_until - clock_timestamp())) * 1000)::bigint) AS lease_ms
    FROM {{T}} e WHERE e.scope = $1 AND e.id = $2 LIMIT 1
), ins AS (
    INSERT INTO {{T}} (scope, id, fingerprint, state, created_at, completed_at, expires_at, part_day)
    SELECT $1, $2, $3, 2, clock_timestamp(), clock_timestamp(), ` + exp + `, ` + partDay(exp) + `
    WHERE NOT EXISTS (SELECT 1 FROM cur)
    RETURNING 1
)
SELECT true, NULL::smallint, NULL::bytea, NULL::bytea, NULL::bigint FROM ins
UNION ALL
SELECT false, state, fingerprint, result, lease_ms FROM cur`),
		// $1 scope, $2 id, $3 fingerprint, $4 retention ms, $5 result.
		// The row Process writes at commit, under the key's lock and
		// after deleteExpired. Every writer of a partitioned table takes
		// that lock, so no live row of the key can be there.
		insertDone: r.Replace(`
INSERT INTO {{T}} (scope, id, fingerprint, state, result, created_at, completed_at, expires_at, part_day)
VALUES ($1, $2, $3, 2, $5, now(), clock_timestamp(), ` + exp + `, ` + partDay(exp) + `)`),
		// $1 scopes, $2 ids, $3 fingerprints, $4 retention ms.
		claimBatch: r.Replace(`
WITH input AS (
    SELECT u.scope, u.id, u.fp, u.ord
    FROM unnest($1::text[], $2::text[], $3::bytea[]) WITH ORDINALITY AS u(scope, id, fp, ord)
), firsts AS (
    SELECT DISTINCT ON (scope, id) scope, id, fp, ord FROM input ORDER BY scope, id, ord
), ins AS (
    INSERT INTO {{T}} (scope, id, fingerprint, state, created_at, completed_at, expires_at, part_day)
    SELECT f.scope, f.id, f.fp, 2, clock_timestamp(), clock_timestamp(), ` + exp + `, ` + partDay(exp) + `
    FROM firsts f
    WHERE NOT EXISTS (SELECT 1 FROM {{T}} e WHERE e.scope = f.scope AND e.id = f.id)
    RETURNING scope, id
)
SELECT f.ord FROM firsts f JOIN ins USING (scope, id)`),
		// $1 scope, $2 id, $3 fingerprint, $4 token, $5 lease ms.
		leaseClaim: r.Replace(`
WITH cur AS (
    SELECT e.state, e.fingerprint, e.result,
           GREATEST(0, (extract(epoch FROM (e.lease_until - clock_timestamp())) * 1000)::bigint) AS lease_ms
    FROM {{T}} e WHERE e.scope = $1 AND e.id = $2 LIMIT 1
), ins AS (
    INSERT INTO {{T}} (scope, id, fingerprint, state, token, lease_until, created_at, expires_at, part_day)
    SELECT $1, $2, $3, 1, $4, ` + leaseExp + `, clock_timestamp(), ` + leaseExp + `, ` + partDay(leaseExp) + `
    WHERE NOT EXISTS (SELECT 1 FROM cur)
    RETURNING 1
)
SELECT true, NULL::smallint, NULL::bytea, NULL::bytea, NULL::bigint FROM ins
UNION ALL
SELECT false, state, fingerprint, result, lease_ms FROM cur`),
		leaseExtend: r.Replace(`
UPDATE {{T}} e SET lease_until = clock_timestamp() + $4 * interval '1 millisecond',
                   expires_at = clock_timestamp() + $4 * interval '1 millisecond',
                   part_day = ` + partDay("clock_timestamp() + $4 * interval '1 millisecond'") + `
WHERE e.scope = $1 AND e.id = $2 AND e.state = 1 AND e.token = $3 AND e.lease_until > clock_timestamp()`),
		leaseComplete: r.Replace(`
UPDATE {{T}} e SET state = 2, token = NULL, lease_until = NULL, result = $5, completed_at = clock_timestamp(),
                   expires_at = clock_timestamp() + $4 * interval '1 millisecond',
                   part_day = ` + partDay("clock_timestamp() + $4 * interval '1 millisecond'") + `
WHERE e.scope = $1 AND e.id = $2 AND e.state = 1 AND e.token = $3 AND e.lease_until > clock_timestamp()`),
		listPartitions: `
SELECT c.relname FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
JOIN pg_class p ON p.oid = i.inhparent
JOIN pg_namespace n ON n.oid = p.relnamespace
WHERE n.nspname = $1 AND p.relname = $2`,
		cleanupDefault: `DELETE FROM {{D}} WHERE ctid = ANY (ARRAY(
    SELECT d.ctid FROM {{D}} d WHERE d.expires_at <= clock_timestamp() LIMIT $1 FOR UPDATE SKIP LOCKED))`,
	}
}

// claimPartitioned runs lock, delete-expired and claim as one batch on q.
func (s *Store) claimPartitioned(ctx context.Context, q pgx.Tx, stmt string, key dedup.Key, args ...any) error {
	var b pgx.Batch
	b.Queue(s.psql.lock, key.Scope, key.ID)
	b.Queue(s.psql.deleteExpired, key.Scope, key.ID)
	b.Queue(stmt, args...)
	br := q.SendBatch(ctx, &b)
	defer func() { _ = br.Close() }()
	if _, err := br.Exec(); err != nil {
		return fmt.Errorf("pgtable: claim %s: lock: %w", key, err)
	}
	if _, err := br.Exec(); err != nil {
		return fmt.Errorf("pgtable: claim %s: %w", key, err)
	}
	var (
		won bool
		e   existing
		st  *int16
		ms  *int64
	)
	if err := br.QueryRow().Scan(&won, &st, &e.fp, &e.result, &ms); err != nil {
		return fmt.Errorf("pgtable: claim %s: %w", key, err)
	}
	if err := br.Close(); err != nil {
		return fmt.Errorf("pgtable: claim %s: %w", key, err)
	}
	if won {
		return nil
	}
	e.state, e.leaseMs = deref(st), deref(ms)
	return verdict(key, e)
}

// claimBatchPartitioned locks every key (in a fixed order, so overlapping
// batches cannot deadlock), deletes their expired rows and inserts the new
// ones. It returns won[j] for the j-th validated key.
func (s *Store) claimBatchPartitioned(ctx context.Context, tx pgx.Tx, scopes, ids []string, fps [][]byte) ([]bool, error) {
	var b pgx.Batch
	b.Queue(s.psql.lockMany, scopes, ids)
	b.Queue(s.psql.deleteExpiredMany, scopes, ids)
	b.Queue(s.psql.claimBatch, scopes, ids, fps, millis(s.opts.Retention))
	br := tx.SendBatch(ctx, &b)
	defer func() { _ = br.Close() }()
	for range 2 {
		if _, err := br.Exec(); err != nil {
			return nil, fmt.Errorf("pgtable: batch claim: %w", err)
		}
	}
	rows, err := br.Query()
	if err != nil {
		return nil, fmt.Errorf("pgtable: batch claim: %w", err)
	}
	won := make([]bool, len(scopes))
	var ord int64
	if _, err := pgx.ForEachRow(rows, []any{&ord}, func() error { won[ord-1] = true; return nil }); err != nil {
		return nil, fmt.Errorf("pgtable: batch claim: %w", err)
	}
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("pgtable: batch claim: %w", err)
	}
	return won, nil
}

// leaseClaimPartitioned runs the lease claim in its own short transaction.
func (s *Store) leaseClaimPartitioned(ctx context.Context, key dedup.Key, token string) error {
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("pgtable: claim %s: begin: %w", key, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	err = s.claimPartitioned(ctx, tx, s.psql.leaseClaim, key, key.Scope, key.ID, key.Fingerprint.Bytes(), token, millis(s.opts.Lease))
	if err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("pgtable: claim %s: commit: %w", key, err)
	}
	return nil
}

const partitionDays = 2 // partitions kept ready beyond the retention horizon

func partitionSuffix(day time.Time) string { return day.Format("20060102") }

// ensurePartitions creates the daily partitions from today (UTC) up to the
// retention horizon plus a margin. Run inside a transaction that holds the
// migration lock.
func (s *Store) ensurePartitions(ctx context.Context, tx pgx.Tx) error {
	today := time.Now().UTC().Truncate(24 * time.Hour)
	var dbToday time.Time
	if err := tx.QueryRow(ctx, "SELECT (clock_timestamp() AT TIME ZONE 'UTC')::date").Scan(&dbToday); err == nil {
		today = dbToday
	}
	days := int(s.opts.Retention/(24*time.Hour)) + partitionDays
	for i := 0; i <= days; i++ {
		from := today.AddDate(0, 0, i)
		to := from.AddDate(0, 0, 1)
		part := sqlname.Qualified(s.opts.Schema, s.opts.Table+"_p"+partitionSuffix(from))
		sql := fmt.Sprintf("CREATE TABLE IF NOT EXISTS %s PARTITION OF %s FOR VALUES FROM ('%s') TO ('%s')",
			part, s.table, from.Format(time.DateOnly), to.Format(time.DateOnly))
		if _, err := tx.Exec(ctx, "SAVEPOINT idem_part"); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, sql); err != nil {
			// Rows for that day already sit in the default partition:
			// leave them there (Cleanup deletes them in batches).
			if _, rerr := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT idem_part"); rerr != nil {
				return errors.Join(err, rerr)
			}
			s.opts.Logger.Warn("pgtable: could not create a partition; its rows stay in the default partition",
				"partition", part, "err", err)
			continue
		}
		if _, err := tx.Exec(ctx, "RELEASE SAVEPOINT idem_part"); err != nil {
			return err
		}
	}
	return nil
}

// EnsurePartitions creates the daily partitions of a partitioned store ahead
// of time. Migrate calls it; CleanupLoop calls it on every tick. Safe to run
// concurrently.
func (s *Store) EnsurePartitions(ctx context.Context) error {
	if !s.opts.Partitioned {
		return nil
	}
	return pgx.BeginFunc(ctx, s.db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", s.lockKey()); err != nil {
			return err
		}
		return s.ensurePartitions(ctx, tx)
	})
}

// cleanupPartitioned drops the partitions of days before today (UTC): all
// their rows expired before today began. Rows in the default partition are
// deleted in bounded batches. Expired rows in today's partition stay until
// tomorrow; claims already treat them as absent.
func (s *Store) cleanupPartitioned(ctx context.Context) (int64, error) {
	rows, err := s.db.Query(ctx, s.psql.listPartitions, s.opts.Schema, s.opts.Table)
	if err != nil {
		return 0, fmt.Errorf("pgtable: cleanup: list partitions: %w", err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return 0, fmt.Errorf("pgtable: cleanup: list partitions: %w", err)
	}
	var today time.Time
	if err := s.db.QueryRow(ctx, "SELECT (clock_timestamp() AT TIME ZONE 'UTC')::date").Scan(&today); err != nil {
		return 0, fmt.Errorf("pgtable: cleanup: %w", err)
	}
	var total int64
	prefix := s.opts.Table + "_p"
	for _, name := range names {
		day, err := time.Parse("20060102", strings.TrimPrefix(name, prefix))
		if err != nil || !strings.HasPrefix(name, prefix) || !day.Before(today) {
			continue // the default partition, or a current one
		}
		part := sqlname.Qualified(s.opts.Schema, name)
		var n int64
		err = pgx.BeginFunc(ctx, s.db, func(tx pgx.Tx) error {
			if err := tx.QueryRow(ctx, "SELECT count(*) FROM "+part).Scan(&n); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "DROP TABLE "+part)
			return err
		})
		if err != nil {
			return total, fmt.Errorf("pgtable: cleanup: drop %s: %w", part, err)
		}
		total += n
	}
	def := strings.ReplaceAll(s.psql.cleanupDefault, "{{D}}", sqlname.Qualified(s.opts.Schema, s.opts.Table+"_pdefault"))
	for {
		tag, err := s.db.Exec(ctx, def, s.opts.CleanupBatch)
		if err != nil {
			return total, fmt.Errorf("pgtable: cleanup default partition: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(s.opts.CleanupBatch) {
			return total, nil
		}
	}
}
