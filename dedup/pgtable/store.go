package pgtable

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/sqlname"
)

// DB is what the store runs statements on: a *pgxpool.Pool, a *pgx.Conn or a
// pgx.Tx.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// Options configure a Store. The zero value is usable.
type Options struct {
	// Schema holds the table. Defaults to "public".
	Schema string
	// Table is the table name. Defaults to "processed_events".
	Table string
	// Retention is how long a completed key is kept after completion. It
	// must outlive every redelivery of a message: the broker's retention
	// and the relay's retry horizon. Defaults to 7 days.
	Retention time.Duration
	// RedeliveryHorizon is the longest time after which a message can still
	// be redelivered, if known. New logs a warning when Retention is
	// shorter. Defaults to 0 (unknown, no warning).
	RedeliveryHorizon time.Duration
	// Lease is the lease duration of the lease mode. Defaults to 30s.
	Lease time.Duration
	// MaxKeyLen limits scope and id, in bytes. Defaults to
	// dedup.DefaultMaxKeyLen.
	MaxKeyLen int
	// KeepKeys stores each key's scope and id in its row, readable for
	// operators. A row is found by the key's digest either way (the first
	// 16 bytes of SHA-256(scope || 0x00 || id), whose first 8 bytes are
	// dedup.Key.Hash); the text costs the length of scope and id plus two
	// bytes a row. Defaults to false: rows hold only the key's digest.
	KeepKeys bool
	// TimeOrderedKeys keeps the order of time-ordered ids in the keys of
	// their rows. The row of a key whose id is a UUID of version 7 (the ids
	// idem's outbox writes) or 6, in its canonical text form, is keyed by
	// the id's first 6 bytes (its timestamp) followed by the first 10 bytes
	// of the key's digest (whose first 8 are dedup.Key.Hash), so the rows
	// of new messages land at the end of the primary key instead of on
	// random pages: a claim writes fewer index pages, and the WAL carries
	// fewer full-page images after each checkpoint. Other ids keep the
	// digest. Every path (claims, Lookup, the lease mode, the migrations)
	// finds a row the same way. The setting is part of the table's
	// contents: turning it on for a table that holds rows of such ids
	// makes a redelivery of those messages claim a new key, so turn it on
	// for a new table, or once the rows written without it are past every
	// redelivery; never turn it off for a table that has rows written with
	// it. Defaults to false: every row is keyed by the digest.
	TimeOrderedKeys bool
	// CleanupBatch is the number of rows one cleanup statement deletes.
	// Defaults to 1000.
	CleanupBatch int
	// Logger receives warnings. Defaults to slog.Default().
	Logger *slog.Logger
	// Partitioned lays the table out partitioned by expires_at (UTC), in
	// ranges of PartitionWidth, so Cleanup detaches and drops whole
	// partitions instead of deleting rows. A unique index cannot span
	// partitions, so every claim (ClaimTx, ClaimBatchTx, the lease mode,
	// Process) first takes a transaction-scoped advisory lock on its key,
	// pg_advisory_xact_lock's single-bigint form, in the same round trip
	// as the claim. Migrate creates the partitions ahead; CleanupLoop (or
	// EnsurePartitions on a schedule) must keep creating them: a claim
	// whose expiry no partition covers fails. Needs PostgreSQL 14 or
	// later. Defaults to false.
	Partitioned bool
	// PartitionWidth is the time range of one partition of a Partitioned
	// table: a whole number of hours that divides a day (1h, 2h, 3h, 4h,
	// 6h, 8h, 12h or 24h), aligned to midnight UTC. A row stays until its
	// partition's range has passed, so rows outlive Retention by at most
	// one width. A claim that misses (the common case) probes the primary
	// key of every partition, Retention / PartitionWidth of them plus the
	// ones made ahead: keep that to a few dozen (hourly partitions with a
	// retention of a day or two, not the 7-day default). The width is part of
	// the table's layout: a table made with 24h (partition key part_day, a
	// date) cannot take a shorter width, and one made with a shorter width
	// (partition key part_hour, a UTC timestamp) cannot take 24h; Migrate
	// says so. Only with Partitioned. Defaults to 24h.
	PartitionWidth time.Duration
	// PartitionLockTimeout bounds how long partition maintenance
	// (EnsurePartitions, and Cleanup detaching and dropping partitions)
	// waits for a lock, as lock_timeout. None of those statements takes a
	// lock that claims wait for; the timeout keeps them from waiting on
	// long transactions: a detach that runs out of time is finished by a
	// later Cleanup. Only with Partitioned. Defaults to 1s.
	PartitionLockTimeout time.Duration
}

// Store is the PostgreSQL store. It is safe for concurrent use when its DB is.
type Store struct {
	db    DB
	opts  Options
	table string // quoted, schema-qualified
	seed  int64  // of the keys' advisory locks (keyLock)
	sql   statements
	psql  partitionedStatements
	part  partitioning // of a Partitioned table
	// retentionArg is Options.Retention in milliseconds, boxed once: it is
	// an argument of every row Process writes.
	retentionArg any
	// batchConflicts counts the batches BeginBatch claimed again with the
	// conflict handling of ClaimBatchTx (a key had a row).
	batchConflicts atomic.Int64
}

var _ dedup.TxStore[pgx.Tx] = (*Store)(nil)

// New returns a Store on db. It does not touch the database; call Migrate (or
// apply SQL) once before use.
func New(db DB, opts Options) (*Store, error) {
	if isNil(db) {
		return nil, errors.New("pgtable: db is nil: pass a *pgxpool.Pool, *pgx.Conn or pgx.Tx")
	}
	if err := sqlname.SchemaTable("pgtable: Options", &opts.Schema, &opts.Table, "processed_events", 50); err != nil {
		return nil, err
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"Retention", opts.Retention}, {"Lease", opts.Lease}, {"RedeliveryHorizon", opts.RedeliveryHorizon},
		{"PartitionLockTimeout", opts.PartitionLockTimeout}} {
		if d.v < 0 {
			return nil, fmt.Errorf("pgtable: Options.%s is %v; it must not be negative (zero means the default)", d.name, d.v)
		}
		if d.v > 0 && d.v < time.Millisecond {
			return nil, fmt.Errorf("pgtable: Options.%s is %v; the store works in milliseconds, use at least 1ms", d.name, d.v)
		}
	}
	if opts.CleanupBatch < 0 {
		return nil, fmt.Errorf("pgtable: Options.CleanupBatch is %d; it must not be negative", opts.CleanupBatch)
	}
	if err := checkPartitionOptions(&opts); err != nil {
		return nil, err
	}
	if opts.Retention == 0 {
		opts.Retention = 7 * 24 * time.Hour
	}
	if opts.Lease == 0 {
		opts.Lease = 30 * time.Second
	}
	if opts.MaxKeyLen <= 0 {
		opts.MaxKeyLen = dedup.DefaultMaxKeyLen
	}
	if opts.CleanupBatch == 0 {
		opts.CleanupBatch = 1000
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.RedeliveryHorizon > 0 && opts.Retention < opts.RedeliveryHorizon {
		opts.Logger.Warn("pgtable: retention is shorter than the redelivery horizon; a message redelivered after its row is deleted runs again",
			"table", opts.Schema+"."+opts.Table, "retention", opts.Retention, "redelivery_horizon", opts.RedeliveryHorizon)
	}
	s := &Store{db: db, opts: opts, table: sqlname.Qualified(opts.Schema, opts.Table)}
	s.retentionArg = millis(opts.Retention)
	s.seed = lockSeed(opts.Schema + "." + opts.Table)
	s.sql = buildStatements(s.table)
	if opts.Partitioned {
		s.part = newPartitioning(opts.PartitionWidth)
		s.psql = buildPartitionedStatements(s.table, s.part)
	}
	return s, nil
}

func isNil(db DB) bool {
	switch v := db.(type) {
	case nil:
		return true
	case *pgxpool.Pool:
		return v == nil
	case *pgx.Conn:
		return v == nil
	}
	return false
}

// Options returns the store's options with defaults filled in.
func (s *Store) Options() Options { return s.opts }

// Table returns the quoted, schema-qualified table name.
func (s *Store) Table() string { return s.table }

func millis(d time.Duration) int64 { return d.Milliseconds() }
