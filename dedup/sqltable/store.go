package sqltable

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/sqldialect"
	"github.com/idemkit/idem/internal/sqlname"
)

// Dialect is the SQL server family behind the *sql.DB.
type Dialect = sqldialect.Dialect

// The dialects a Store speaks.
const (
	// Postgres is PostgreSQL through database/sql (pgx's stdlib driver or
	// lib/pq).
	Postgres = sqldialect.Postgres
	// MySQL is MySQL 8 or MariaDB 10.6 and later, with InnoDB tables
	// (go-sql-driver/mysql).
	MySQL = sqldialect.MySQL
	// SQLite is SQLite 3.35 or later (modernc.org/sqlite, or another
	// driver).
	SQLite = sqldialect.SQLite
)

// ErrTransient marks an error of the server that says nothing about the
// key: a deadlock, a lock wait that timed out, a serialization failure, a
// busy SQLite database. The transaction was rolled back (or must be); run
// the whole of it again. It is never dedup.ErrDuplicate.
var ErrTransient = errors.New("sqltable: transient database error: retry the transaction")

// ErrIsolation is returned by the first call on a MySQL store whose
// sessions run at an isolation level the store does not support.
var ErrIsolation = errors.New("sqltable: unsupported transaction isolation level")

// transientError wraps a driver error that Dialect.Transient classifies.
type transientError struct{ err error }

func (e *transientError) Error() string        { return e.err.Error() + " (transient: retry)" }
func (e *transientError) Unwrap() error        { return e.err }
func (e *transientError) Is(target error) bool { return target == ErrTransient }

// Options configure a Store. The zero value is usable.
type Options struct {
	// Schema qualifies the table: a PostgreSQL schema (Migrate creates
	// it), a MySQL database or an attached SQLite database (both must
	// exist). Defaults to "" (the connection's own: search_path, the
	// current database, main).
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
	// dedup.Key.Hash). Defaults to false: rows hold only the digest.
	KeepKeys bool
	// CleanupBatch is the number of rows one cleanup statement deletes.
	// Defaults to 1000.
	CleanupBatch int
	// Logger receives warnings. Defaults to slog.Default().
	Logger *slog.Logger
}

// Store is the database/sql store. It is safe for concurrent use.
type Store struct {
	db      *sql.DB
	dialect Dialect
	opts    Options
	table   string // quoted, qualified when Options.Schema is set
	sql     statements

	retentionMs, leaseMs int64

	// checked is set once the server's isolation level was found
	// supported (MySQL); until then every call checks it.
	mu      sync.Mutex
	checked bool
}

var _ dedup.TxStore[*sql.Tx] = (*Store)(nil)

// New returns a Store on db, which speaks dialect. It does not touch the
// database; call Migrate (or apply SQL) once before use.
func New(db *sql.DB, dialect Dialect, opts Options) (*Store, error) {
	if db == nil {
		return nil, errors.New("sqltable: db is nil: pass the *sql.DB of sql.Open")
	}
	if !dialect.Valid() {
		return nil, fmt.Errorf("sqltable: dialect %v is not supported: use sqltable.Postgres, sqltable.MySQL or sqltable.SQLite", dialect)
	}
	if opts.Schema != "" {
		if err := sqlname.Check("sqltable: Options.Schema", opts.Schema); err != nil {
			return nil, err
		}
	}
	if opts.Table == "" {
		opts.Table = "processed_events"
	}
	if err := sqlname.Check("sqltable: Options.Table", opts.Table); err != nil {
		return nil, err
	}
	if len(opts.Table) > 50 {
		return nil, fmt.Errorf("sqltable: Options.Table %q is longer than 50 bytes; the names of its index and migrations table are derived from it", opts.Table)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"Retention", opts.Retention}, {"Lease", opts.Lease}, {"RedeliveryHorizon", opts.RedeliveryHorizon}} {
		if d.v < 0 {
			return nil, fmt.Errorf("sqltable: Options.%s is %v; it must not be negative (zero means the default)", d.name, d.v)
		}
		if d.v > 0 && d.v < time.Millisecond {
			return nil, fmt.Errorf("sqltable: Options.%s is %v; the store works in milliseconds, use at least 1ms", d.name, d.v)
		}
	}
	if opts.CleanupBatch < 0 {
		return nil, fmt.Errorf("sqltable: Options.CleanupBatch is %d; it must not be negative", opts.CleanupBatch)
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
	s := &Store{db: db, dialect: dialect, opts: opts, table: qualified(dialect, opts.Schema, opts.Table),
		retentionMs: opts.Retention.Milliseconds(), leaseMs: opts.Lease.Milliseconds()}
	if opts.RedeliveryHorizon > 0 && opts.Retention < opts.RedeliveryHorizon {
		opts.Logger.Warn("sqltable: retention is shorter than the redelivery horizon; a message redelivered after its row is deleted runs again",
			"table", s.table, "retention", opts.Retention, "redelivery_horizon", opts.RedeliveryHorizon)
	}
	s.sql = buildStatements(dialect, s.table)
	return s, nil
}

func qualified(d Dialect, schema, name string) string {
	if schema == "" {
		return d.Quote(name)
	}
	return d.Quote(schema) + "." + d.Quote(name)
}

// Options returns the store's options with defaults filled in.
func (s *Store) Options() Options { return s.opts }

// Dialect returns the store's dialect.
func (s *Store) Dialect() Dialect { return s.dialect }

// Table returns the quoted, qualified table name.
func (s *Store) Table() string { return s.table }

// keyDigest is the primary key of a key's row: the first 16 bytes of
// SHA-256(scope || 0x00 || id). dedup.Key.Hash shows the first 8 bytes of
// the same digest, so a row can be matched to a log line.
func keyDigest(scope, id string) []byte {
	h := sha256.New()
	h.Write([]byte(scope))
	h.Write([]byte{0})
	h.Write([]byte(id))
	return h.Sum(nil)[:16]
}

// keyArgs is what a statement needs of a key: its digest and, with
// Options.KeepKeys, its scope and id (else NULL).
type keyArgs struct {
	digest    []byte
	fp        []byte
	scope, id any
}

func (s *Store) keyArgs(k dedup.Key) keyArgs {
	a := keyArgs{digest: keyDigest(k.Scope, k.ID), fp: k.Fingerprint.Bytes()}
	if s.opts.KeepKeys {
		a.scope, a.id = k.Scope, k.ID
	}
	return a
}

// wrap names op and key in a database error, and marks it ErrTransient
// when the dialect classifies it so.
func (s *Store) wrap(op string, key dedup.Key, err error) error {
	if s.dialect.Transient(err) {
		err = &transientError{err: err}
	}
	return fmt.Errorf("sqltable: %s %s: %w", op, key, err)
}

// The isolation levels a MySQL or MariaDB session may run at. A duplicate's
// INSERT waits on the first transaction's row at all of them; READ
// UNCOMMITTED is refused because it lets a handler's reads see writes of
// transactions that may still roll back.
var supportedIsolation = map[string]bool{"READ-COMMITTED": true, "REPEATABLE-READ": true, "SERIALIZABLE": true}

// ready checks, once per store, what the store needs of the server: on
// MySQL and MariaDB, a supported isolation level. A failed check (the
// server is down) is tried again on the next call.
func (s *Store) ready(ctx context.Context) error {
	if s.dialect != MySQL {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.checked {
		return nil
	}
	level, err := s.isolation(ctx)
	if err != nil {
		return err
	}
	if !supportedIsolation[level] {
		return fmt.Errorf("%w: the server's sessions run at %s; the store supports READ COMMITTED, REPEATABLE READ and SERIALIZABLE "+
			"(set transaction_isolation, or tx_isolation on MariaDB before 11.1, in the server's configuration or the DSN)", ErrIsolation, level)
	}
	s.checked = true
	return nil
}

// isolation returns the session isolation level of one of db's
// connections, as MySQL spells it (REPEATABLE-READ).
func (s *Store) isolation(ctx context.Context) (string, error) {
	var level string
	err := s.db.QueryRowContext(ctx, "SELECT @@SESSION.transaction_isolation").Scan(&level)
	if n, ok := sqldialect.MySQLNumber(err); ok && n == 1193 { // unknown variable: MariaDB before 11.1
		err = s.db.QueryRowContext(ctx, "SELECT @@SESSION.tx_isolation").Scan(&level)
	}
	if err != nil {
		return "", fmt.Errorf("sqltable: reading the isolation level of %s: %w", s.table, err)
	}
	return strings.ToUpper(strings.TrimSpace(level)), nil
}
