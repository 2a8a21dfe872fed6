package pgtable

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/pgdirect"
	"github.com/idemkit/idem/internal/pgmigrate"
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
	listPartitions                                   string
}

// partitioning is the partition layout of a Partitioned table.
type partitioning struct {
	width  time.Duration
	column string // the partition key column
	typ    string // its type
	suffix string // time layout of a partition name's suffix: the range's start
}

// newPartitioning returns the layout for a width checkPartitionOptions
// accepted. Daily partitions are keyed by the UTC day of expires_at (a
// date), shorter ones by its UTC hour (a timestamp without time zone, so
// the session's time zone never shifts a row's partition).
func newPartitioning(width time.Duration) partitioning {
	if width == 24*time.Hour {
		return partitioning{width: width, column: "part_day", typ: "date", suffix: "20060102"}
	}
	return partitioning{width: width, column: "part_hour", typ: "timestamp", suffix: "2006010215"}
}

// key is the SQL expression of the partition key of a row expiring at expr.
func (p partitioning) key(expr string) string {
	if p.typ == "date" {
		return "((" + expr + ") AT TIME ZONE 'UTC')::date"
	}
	return "date_trunc('hour', (" + expr + ") AT TIME ZONE 'UTC')"
}

// bound is the SQL literal of a range bound at t, a multiple of the width.
func (p partitioning) bound(t time.Time) string {
	if p.typ == "date" {
		return "'" + t.UTC().Format(time.DateOnly) + "'"
	}
	return "'" + t.UTC().Format(time.DateTime) + "'"
}

// checkPartitionOptions checks the partition options and fills in their
// defaults.
func checkPartitionOptions(opts *Options) error {
	if !opts.Partitioned {
		if opts.PartitionWidth != 0 || opts.PartitionLockTimeout != 0 {
			return errors.New("pgtable: Options.PartitionWidth and Options.PartitionLockTimeout apply to a partitioned table: set Options.Partitioned or leave them zero")
		}
		return nil
	}
	if opts.PartitionWidth == 0 {
		opts.PartitionWidth = 24 * time.Hour
	}
	if w := opts.PartitionWidth; w < time.Hour || w%time.Hour != 0 || (24*time.Hour)%w != 0 {
		return fmt.Errorf("pgtable: Options.PartitionWidth is %v; use a whole number of hours that divides a day: 1h, 2h, 3h, 4h, 6h, 8h, 12h or 24h", w)
	}
	if opts.PartitionLockTimeout == 0 {
		opts.PartitionLockTimeout = time.Second
	}
	return nil
}

func lockSeed(name string) int64 {
	h := fnv.New64a()
	h.Write([]byte("idem:pgtable:key:" + name))
	return int64(h.Sum64())
}

func buildPartitionedStatements(table string, p partitioning) partitionedStatements {
	r := strings.NewReplacer("{{T}}", table, "{{EXPIRED}}", expiredRow, "{{STATE}}", stateSQL, "{{LEASE}}", leaseMsSQL, "{{P}}", p.column)
	partKey := p.key
	exp := "clock_timestamp() + $3 * interval '1 millisecond'"
	leaseExp := "clock_timestamp() + $4 * interval '1 millisecond'"
	return partitionedStatements{
		// $1 the key's lock (keyLock).
		lock: "SELECT pg_advisory_xact_lock($1::bigint)",
		// $1 the keys' locks, in any order and with repeats.
		lockMany: "SELECT count(pg_advisory_xact_lock(h)) FROM (SELECT DISTINCT h FROM unnest($1::bigint[]) AS h ORDER BY 1) AS k",
		// $1 key.
		deleteExpired: r.Replace(`DELETE FROM {{T}} e WHERE e.key = $1 AND {{EXPIRED}}`),
		// $1 keys.
		deleteExpiredMany: r.Replace(`DELETE FROM {{T}} e WHERE e.key = ANY ($1::uuid[]) AND {{EXPIRED}}`),
		// $1 key, $2 fingerprint, $3 retention ms, $4 scope, $5 id.
		claimTx: r.Replace(`
WITH cur AS (
    SELECT {{STATE}}, e.fingerprint, e.result, {{LEASE}}
    FROM {{T}} e WHERE e.key = $1 LIMIT 1
), ins AS (
    INSERT INTO {{T}} (key, expires_at, {{P}}, fingerprint, scope, id)
    SELECT $1, ` + exp + `, ` + partKey(exp) + `, $2, $4, $5
    WHERE NOT EXISTS (SELECT 1 FROM cur)
    RETURNING 1
)
SELECT true, NULL::smallint, NULL::bytea, NULL::bytea, NULL::bigint FROM ins
UNION ALL
SELECT false, * FROM cur`),
		// $1 key, $2 fingerprint, $3 retention ms, $4 result, $5 scope,
		// $6 id. The row Process writes at commit, under the key's lock
		// and after deleteExpired. Every writer of a partitioned table
		// takes that lock, so no live row of the key can be there.
		insertDone: r.Replace(`
INSERT INTO {{T}} (key, expires_at, {{P}}, fingerprint, result, scope, id)
VALUES ($1, ` + exp + `, ` + partKey(exp) + `, $2, $4, $5, $6)`),
		// $1 keys, $2 fingerprints, $3 retention ms, $4 scopes, $5 ids
		// (NULL unless kept).
		claimBatch: r.Replace(`
WITH input AS (
    SELECT u.key, u.fp, u.scope, u.id, u.ord
    FROM unnest($1::uuid[], $2::bytea[], $4::text[], $5::text[]) WITH ORDINALITY AS u(key, fp, scope, id, ord)
), firsts AS (
    SELECT DISTINCT ON (key) key, fp, scope, id, ord FROM input ORDER BY key, ord
), ins AS (
    INSERT INTO {{T}} (key, expires_at, {{P}}, fingerprint, scope, id)
    SELECT f.key, ` + exp + `, ` + partKey(exp) + `, f.fp, f.scope, f.id
    FROM firsts f
    WHERE NOT EXISTS (SELECT 1 FROM {{T}} e WHERE e.key = f.key)
    RETURNING key
)
SELECT f.ord FROM firsts f JOIN ins USING (key)`),
		// $1 key, $2 fingerprint, $3 token, $4 lease ms, $5 scope, $6 id.
		leaseClaim: r.Replace(`
WITH cur AS (
    SELECT {{STATE}}, e.fingerprint, e.result, {{LEASE}}
    FROM {{T}} e WHERE e.key = $1 LIMIT 1
), ins AS (
    INSERT INTO {{T}} (key, expires_at, {{P}}, fingerprint, token, scope, id)
    SELECT $1, ` + leaseExp + `, ` + partKey(leaseExp) + `, $2, $3, $5, $6
    WHERE NOT EXISTS (SELECT 1 FROM cur)
    RETURNING 1
)
SELECT true, NULL::smallint, NULL::bytea, NULL::bytea, NULL::bigint FROM ins
UNION ALL
SELECT false, * FROM cur`),
		// $1 key, $2 token, $3 lease ms.
		leaseExtend: r.Replace(`
UPDATE {{T}} e SET expires_at = ` + exp + `, {{P}} = ` + partKey(exp) + `
WHERE e.key = $1 AND e.token = $2 AND e.expires_at > clock_timestamp()`),
		// $1 key, $2 token, $3 retention ms, $4 result.
		leaseComplete: r.Replace(`
UPDATE {{T}} e SET token = NULL, result = $4, expires_at = ` + exp + `, {{P}} = ` + partKey(exp) + `
WHERE e.key = $1 AND e.token = $2 AND e.expires_at > clock_timestamp()`),
		// $1 schema, $2 name prefix, $3 the table. The table's partitions,
		// and tables named like one but attached to no table (a partition
		// detached by a Cleanup that could not drop it).
		listPartitions: `
SELECT c.relname, i.inhrelid IS NOT NULL, coalesce(i.inhdetachpending, false), c.reltuples::bigint
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_inherits i ON i.inhrelid = c.oid
WHERE n.nspname = $1 AND c.relkind = 'r' AND left(c.relname, length($2)) = $2
  AND (i.inhparent = $3::regclass OR (i.inhrelid IS NULL AND NOT c.relispartition))`,
	}
}

// claimPartitioned runs lock, delete-expired and claim as one batch on q.
func (s *Store) claimPartitioned(ctx context.Context, q pgx.Tx, stmt string, key dedup.Key, a keyArgs, args ...any) error {
	var b pgx.Batch
	b.Queue(s.psql.lock, a.lock)
	b.Queue(s.psql.deleteExpired, a.digest)
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
		return fmt.Errorf("pgtable: claim %s: %w", key, partitionHint(err))
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
// ones. It returns won[j] for the j-th key of c.
func (s *Store) claimBatchPartitioned(ctx context.Context, tx pgx.Tx, c *claimBatch) ([]bool, error) {
	var b pgx.Batch
	b.Queue(s.psql.lockMany, c.locks)
	b.Queue(s.psql.deleteExpiredMany, c.digests)
	b.Queue(s.psql.claimBatch, c.digests, c.fps, s.retentionArg, c.scopes, c.ids)
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
	won := make([]bool, len(c.digests))
	var ord int64
	if _, err := pgx.ForEachRow(rows, []any{&ord}, func() error { won[ord-1] = true; return nil }); err != nil {
		return nil, fmt.Errorf("pgtable: batch claim: %w", partitionHint(err))
	}
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("pgtable: batch claim: %w", err)
	}
	return won, nil
}

// leaseClaimPartitioned runs the lease claim in its own short transaction.
func (s *Store) leaseClaimPartitioned(ctx context.Context, key dedup.Key, a keyArgs, token string) error {
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("pgtable: claim %s: begin: %w", key, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	err = s.claimPartitioned(ctx, tx, s.psql.leaseClaim, key, a, a.digest, key.Fingerprint.Bytes(), token, millis(s.opts.Lease), a.scope, a.id)
	if err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("pgtable: claim %s: commit: %w", key, err)
	}
	return nil
}

// partitionMargin is how far beyond the retention horizon partitions are
// made ahead, at least: claims keep working that long without
// EnsurePartitions. Two partitions are made ahead when that is longer.
const partitionMargin = 6 * time.Hour

// partitionName is the unquoted name of the partition whose range starts
// at from.
func (s *Store) partitionName(from time.Time) string {
	return s.opts.Table + "_p" + from.UTC().Format(s.part.suffix)
}

// partitionStart parses a partition name; ok is false for any other name.
func (s *Store) partitionStart(name string) (from time.Time, ok bool) {
	suffix, found := strings.CutPrefix(name, s.opts.Table+"_p")
	if !found || len(suffix) != len(s.part.suffix) {
		return time.Time{}, false
	}
	from, err := time.Parse(s.part.suffix, suffix)
	return from, err == nil
}

// wantedPartitions returns the starts of the partitions that must exist at
// now: from the one holding now up to the retention (or lease) horizon plus
// the margin.
func (s *Store) wantedPartitions(now time.Time) []time.Time {
	w := s.part.width
	ahead := max(s.opts.Retention, s.opts.Lease) + max(partitionMargin, 2*w)
	var out []time.Time
	for from := now.UTC().Truncate(w); !from.After(now.Add(ahead)); from = from.Add(w) {
		out = append(out, from)
	}
	return out
}

// dbNow reads the database clock, which every expiry comes from.
func dbNow(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (time.Time, error) {
	var now time.Time
	err := q.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&now)
	return now, err
}

// checkLayout fails when the table is partitioned by another key than the
// options' PartitionWidth uses.
func (s *Store) checkLayout(ctx context.Context, tx pgx.Tx) error {
	var col string
	err := tx.QueryRow(ctx, `SELECT a.attname FROM pg_partitioned_table p
JOIN pg_attribute a ON a.attrelid = p.partrelid AND a.attnum = p.partattrs[0]
WHERE p.partrelid = $1::regclass`, s.table).Scan(&col)
	if err != nil {
		return fmt.Errorf("pgtable: %s is not a partitioned table (run Migrate with Options.Partitioned): %w", s.table, err)
	}
	if col != s.part.column {
		return fmt.Errorf("pgtable: %s is partitioned by %s, but Options.PartitionWidth %v needs a table partitioned by %s: "+
			"keep the width the table was made with, or use a new Options.Table", s.table, col, s.opts.PartitionWidth, s.part.column)
	}
	return nil
}

// createPartition creates the partition starting at from unless a table of
// its name exists. It creates a plain table and attaches it: ATTACH
// PARTITION takes a SHARE UPDATE EXCLUSIVE lock on the parent, which claims
// do not wait for, where CREATE TABLE ... PARTITION OF would take an ACCESS
// EXCLUSIVE one and queue every claim behind the longest transaction. Run
// inside a transaction.
func (s *Store) createPartition(ctx context.Context, tx pgx.Tx, from time.Time) error {
	name := sqlname.Qualified(s.opts.Schema, s.partitionName(from))
	var exists bool
	if err := tx.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", name).Scan(&exists); err != nil || exists {
		return err
	}
	if _, err := tx.Exec(ctx, "CREATE TABLE "+name+" (LIKE "+s.table+" INCLUDING ALL)"); err != nil {
		return fmt.Errorf("pgtable: create partition %s: %w", name, err)
	}
	if _, err := tx.Exec(ctx, fmt.Sprintf("ALTER TABLE %s ATTACH PARTITION %s FOR VALUES FROM (%s) TO (%s)",
		s.table, name, s.part.bound(from), s.part.bound(from.Add(s.part.width)))); err != nil {
		return fmt.Errorf("pgtable: attach partition %s: %w", name, err)
	}
	return nil
}

// ensurePartitions creates the partitions from the current one up to the
// retention horizon plus a margin, in tx. Migrate runs it in its
// transaction, under the migration lock.
func (s *Store) ensurePartitions(ctx context.Context, tx pgx.Tx) error {
	if err := s.checkLayout(ctx, tx); err != nil {
		return err
	}
	now, err := dbNow(ctx, tx)
	if err != nil {
		return fmt.Errorf("pgtable: partitions: %w", err)
	}
	for _, from := range s.wantedPartitions(now) {
		if err := s.createPartition(ctx, tx, from); err != nil {
			return err
		}
	}
	return nil
}

// EnsurePartitions creates the partitions of a partitioned store ahead of
// time: from the current one up to Options.Retention plus a margin (6 hours
// or two partitions, whichever is longer). Migrate calls it; CleanupLoop
// calls it on every tick; a store that does not run CleanupLoop must call
// it on a schedule, since a claim whose expiry no partition covers fails.
// Each partition is created and attached in a transaction of its own under
// Options.PartitionLockTimeout. Claims do not wait for it. Safe to run
// concurrently.
func (s *Store) EnsurePartitions(ctx context.Context) error {
	if !s.opts.Partitioned {
		return nil
	}
	now, err := dbNow(ctx, s.db)
	if err != nil {
		return fmt.Errorf("pgtable: partitions: %w", err)
	}
	var names []string
	for _, from := range s.wantedPartitions(now) {
		names = append(names, sqlname.Qualified(s.opts.Schema, s.partitionName(from)))
	}
	rows, err := s.db.Query(ctx, "SELECT n FROM unnest($1::text[]) n WHERE to_regclass(n) IS NULL", names)
	if err != nil {
		return fmt.Errorf("pgtable: partitions: %w", err)
	}
	missing, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("pgtable: partitions: %w", err)
	}
	for i, from := range s.wantedPartitions(now) {
		if !slices.Contains(missing, names[i]) {
			continue
		}
		err := pgx.BeginFunc(ctx, s.db, func(tx pgx.Tx) error {
			// Not on a store made on a pgx.Tx: SET LOCAL would outlast
			// this savepoint, into the caller's transaction.
			if _, onTx := s.db.(pgx.Tx); !onTx {
				if _, err := tx.Exec(ctx, fmt.Sprintf("SET LOCAL lock_timeout = %d", s.opts.PartitionLockTimeout.Milliseconds())); err != nil {
					return err
				}
			}
			if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", s.lockKey()); err != nil {
				return err
			}
			if err := s.checkLayout(ctx, tx); err != nil {
				return err
			}
			return s.createPartition(ctx, tx, from)
		})
		if err != nil {
			return fmt.Errorf("pgtable: partitions of %s: %w", s.table, err)
		}
	}
	return nil
}

// maintenanceConn returns a connection of its own for statements that
// cannot run in a transaction block, and a function that gives it back.
func (s *Store) maintenanceConn(ctx context.Context) (*pgx.Conn, func(), error) {
	switch db := s.db.(type) {
	case *pgxpool.Pool:
		c, err := db.Acquire(ctx)
		if err != nil {
			return nil, nil, err
		}
		return c.Conn(), c.Release, nil
	case *pgx.Conn:
		return db, func() {}, nil
	}
	return nil, nil, fmt.Errorf("pgtable: cleanup of a partitioned table runs ALTER TABLE ... DETACH PARTITION ... CONCURRENTLY, "+
		"which needs a connection outside any transaction: give New a *pgxpool.Pool or *pgx.Conn, not a %T", s.db)
}

func (s *Store) cleanupLockKey() int64 {
	return pgmigrate.LockKey("idem:pgtable:cleanup:" + s.opts.Schema + "." + s.opts.Table)
}

// partitionHint says what to do about a row that no partition covers.
func partitionHint(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "23514" && strings.HasPrefix(pgErr.Message, "no partition of relation") {
		return fmt.Errorf("%w (no partition covers the row's expiry: run CleanupLoop, or EnsurePartitions on a schedule)", err)
	}
	return err
}

// isLockTimeout reports a statement cancelled by lock_timeout.
func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03"
}

// cleanupPartitioned detaches and drops the partitions whose range has
// passed: all their rows expired. Expired rows in the current partition stay
// until its range has passed; claims already treat them as absent.
//
// A partition is detached with DETACH PARTITION ... CONCURRENTLY, which
// takes no lock that claims wait for, then waits for the transactions that
// may still read it. Every statement runs under Options.PartitionLockTimeout:
// a detach that runs out of time stays pending and the next call finishes it
// (DETACH PARTITION ... FINALIZE) and drops the table. The count of a dropped
// partition's rows is the planner's estimate (pg_class.reltuples, 0 for a
// table never analyzed): counting them would read the whole partition.
func (s *Store) cleanupPartitioned(ctx context.Context) (int64, error) {
	conn, release, err := s.maintenanceConn(ctx)
	if err != nil {
		return 0, err
	}
	defer release()
	// Before the session setting and lock: through a pooler they would
	// stay on a server connection that other clients get next.
	probe, err := pgdirect.Detect(ctx, conn)
	if err != nil {
		return 0, fmt.Errorf("pgtable: cleanup %s: %w", s.table, err)
	}
	if probe.Pooled() {
		return 0, fmt.Errorf("pgtable: cleanup of the partitioned table %s needs a session of its own: ALTER TABLE ... DETACH PARTITION ... CONCURRENTLY "+
			"cannot run in a transaction, so it runs under a session-level advisory lock and lock_timeout, which a pooler in transaction mode "+
			"(PgBouncer's pool_mode=transaction) does not keep, and the store's connection is %s: run Cleanup (or CleanupLoop) on a Store made "+
			"with the same Options on a pool that connects to PostgreSQL itself; claims, Migrate and EnsurePartitions may stay on the pooler",
			s.table, probe)
	}
	if _, err := conn.Exec(ctx, fmt.Sprintf("SET lock_timeout = %d", s.opts.PartitionLockTimeout.Milliseconds())); err != nil {
		return 0, fmt.Errorf("pgtable: cleanup %s: %w", s.table, err)
	}
	defer func() {
		if _, err := conn.Exec(context.WithoutCancel(ctx), "RESET lock_timeout"); err != nil {
			_ = conn.Close(context.WithoutCancel(ctx)) // a pool drops a closed connection
		}
	}()
	// One cleanup at a time per table: a second one would find the
	// first one's detach pending and try to finish it.
	var locked bool
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", s.cleanupLockKey()).Scan(&locked); err != nil {
		return 0, fmt.Errorf("pgtable: cleanup %s: %w", s.table, err)
	}
	if !locked {
		return 0, nil
	}
	defer func() {
		if _, err := conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", s.cleanupLockKey()); err != nil {
			_ = conn.Close(context.WithoutCancel(ctx))
		}
	}()
	now, err := dbNow(ctx, conn)
	if err != nil {
		return 0, fmt.Errorf("pgtable: cleanup %s: %w", s.table, err)
	}
	type partition struct {
		name              string
		attached, pending bool
		rows              int64
	}
	rows, err := conn.Query(ctx, s.psql.listPartitions, s.opts.Schema, s.opts.Table+"_p", s.table)
	if err != nil {
		return 0, fmt.Errorf("pgtable: cleanup %s: list partitions: %w", s.table, err)
	}
	parts, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (p partition, err error) {
		err = r.Scan(&p.name, &p.attached, &p.pending, &p.rows)
		return p, err
	})
	if err != nil {
		return 0, fmt.Errorf("pgtable: cleanup %s: list partitions: %w", s.table, err)
	}
	var total int64
	for _, p := range parts {
		from, ok := s.partitionStart(p.name)
		if !ok || from.Add(s.part.width).After(now) {
			continue // not a partition of this layout, or its range has not passed
		}
		name := sqlname.Qualified(s.opts.Schema, p.name)
		var stmts []string
		switch {
		case p.pending:
			stmts = append(stmts, "ALTER TABLE "+s.table+" DETACH PARTITION "+name+" FINALIZE")
		case p.attached:
			stmts = append(stmts, "ALTER TABLE "+s.table+" DETACH PARTITION "+name+" CONCURRENTLY")
		}
		stmts = append(stmts, "DROP TABLE "+name)
		var failed string
		for _, stmt := range stmts {
			if _, err = conn.Exec(ctx, stmt); err != nil {
				failed = stmt
				break
			}
		}
		if isLockTimeout(err) {
			s.opts.Logger.Info("pgtable: cleanup: a partition is still in use; the next cleanup retries",
				"table", s.table, "partition", p.name, "statement", failed, "err", err)
			continue
		}
		if err != nil {
			return total, fmt.Errorf("pgtable: cleanup %s: %s: %w", s.table, failed, err)
		}
		total += max(p.rows, 0)
	}
	return total, nil
}
