package sqltable_test

import (
	"context"
	"database/sql"
	"net/url"
	"path/filepath"
	"strings"
	"testing"

	// The drivers the tests run the store on.
	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"
	_ "github.com/lib/pq"
	"go.uber.org/goleak"
	_ "modernc.org/sqlite"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, testenv.LeakOptions()...) }

// backend is one driver the store runs on.
type backend struct {
	name    string
	dialect sqltable.Dialect
	// open returns a database on the running server, closed with t.
	open func(t testing.TB) *sql.DB
	// down returns a database whose server cannot be reached.
	down func(t testing.TB) *sql.DB
	// past is the SQL of a time before now, in expires_at's type.
	past string
}

func openDB(t testing.TB, driver, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open(driver, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// pgOpen opens the test PostgreSQL through driver ("pgx" or "postgres"),
// skipping the test when the server is down.
func pgOpen(driver string) func(t testing.TB) *sql.DB {
	return func(t testing.TB) *sql.DB {
		t.Helper()
		testenv.Pool(t, 1) // skips, or fails under CI, when PostgreSQL is down
		db := openDB(t, driver, testenv.PostgresURL())
		db.SetMaxOpenConns(40)
		return db
	}
}

func pgDown(driver string) func(t testing.TB) *sql.DB {
	return func(t testing.TB) *sql.DB {
		return openDB(t, driver, "postgres://postgres@"+testenv.DeadAddr(t)+"/test?sslmode=disable&connect_timeout=2")
	}
}

// sqliteDSN is a database file of the test's own, in WAL mode, with BEGIN
// IMMEDIATE transactions and a busy timeout, as the package doc asks.
func sqliteDSN(path string) string {
	return "file:" + path + "?_txlock=immediate&_pragma=busy_timeout(30000)&_pragma=journal_mode(WAL)"
}

var backends = []backend{
	{name: "postgres-pgx", dialect: sqltable.Postgres, open: pgOpen("pgx"), down: pgDown("pgx"),
		past: "clock_timestamp() - interval '1 second'"},
	{name: "postgres-pq", dialect: sqltable.Postgres, open: pgOpen("postgres"), down: pgDown("postgres"),
		past: "clock_timestamp() - interval '1 second'"},
	{name: "mysql", dialect: sqltable.MySQL,
		open: func(t testing.TB) *sql.DB {
			db := testenv.MySQL(t, "")
			db.SetMaxOpenConns(40)
			return db
		},
		down: func(t testing.TB) *sql.DB {
			return openDB(t, "mysql", "root@tcp("+testenv.DeadAddr(t)+")/test?timeout=2s")
		},
		past: "UTC_TIMESTAMP(6) - INTERVAL 1 SECOND"},
	{name: "sqlite", dialect: sqltable.SQLite,
		open: func(t testing.TB) *sql.DB {
			db := openDB(t, "sqlite", sqliteDSN(filepath.Join(t.TempDir(), "idem.db")))
			db.SetMaxOpenConns(8)
			return db
		},
		// SQLite has no server: the database that cannot be reached is a
		// file that cannot be opened, in a directory that does not exist.
		down: func(t testing.TB) *sql.DB {
			return openDB(t, "sqlite", sqliteDSN(filepath.Join(t.TempDir(), "missing", "idem.db"))+"&mode=rw")
		},
		past: "0"},
}

// newStore makes a store on its own table (PostgreSQL: its own schema) and
// migrates it.
func newStore(t testing.TB, b backend, db *sql.DB, opts sqltable.Options) *sqltable.Store {
	t.Helper()
	ctx := context.Background()
	switch b.dialect {
	case sqltable.Postgres:
		if opts.Schema == "" {
			opts.Schema = testenv.Name("idemsql")
			t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP SCHEMA IF EXISTS "`+opts.Schema+`" CASCADE`) })
		}
	case sqltable.MySQL:
		if opts.Table == "" {
			opts.Table = testenv.Name("pe")
			t.Cleanup(func() {
				_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS `"+opts.Table+"`, `"+opts.Table+"_migrations`")
			})
		}
	}
	s, err := sqltable.New(db, b.dialect, opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return s
}

func downStore(t testing.TB, b backend) *sqltable.Store {
	s, err := sqltable.New(b.down(t), b.dialect, sqltable.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// expireAll back-dates every row past its retention and runs the cleanup,
// which must then delete them.
func expireAll(t testing.TB, b backend, db *sql.DB, s *sqltable.Store) {
	t.Helper()
	ctx := context.Background()
	res, err := db.ExecContext(ctx, "UPDATE "+s.Table()+" SET expires_at = "+b.past)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := res.RowsAffected()
	n, err := s.Cleanup(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != want {
		t.Fatalf("cleanup deleted %d rows, %d were expired", n, want)
	}
}

func TestConformanceTx(t *testing.T) {
	t.Parallel()
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			db := b.open(t)
			deduptest.RunTx(t, deduptest.TxHarness[*sql.Tx]{
				New:    func(t testing.TB) dedup.TxStore[*sql.Tx] { return newStore(t, b, db, sqltable.Options{}) },
				Down:   func(t testing.TB) dedup.TxStore[*sql.Tx] { return downStore(t, b) },
				Expire: func(t testing.TB, s dedup.TxStore[*sql.Tx]) { expireAll(t, b, db, s.(*sqltable.Store)) },
			})
		})
	}
}

func TestConformanceLease(t *testing.T) {
	t.Parallel()
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			db := b.open(t)
			deduptest.RunLease(t, deduptest.LeaseHarness{
				New: func(t testing.TB, cfg deduptest.Config) deduptest.LeaseInstance {
					s := newStore(t, b, db, sqltable.Options{Lease: cfg.Lease, Retention: cfg.TTL})
					return deduptest.LeaseInstance{Store: s.Lease()}
				},
				Down: func(t testing.TB) dedup.LeaseStore { return downStore(t, b).Lease() },
			})
		})
	}
}

func TestOptionErrors(t *testing.T) {
	t.Parallel()
	db := openDB(t, "sqlite", "file::memory:")
	cases := []struct {
		name    string
		db      *sql.DB
		dialect sqltable.Dialect
		opts    sqltable.Options
		want    string
	}{
		{"nil db", nil, sqltable.SQLite, sqltable.Options{}, "db is nil"},
		{"no dialect", db, 0, sqltable.Options{}, "dialect"},
		{"unknown dialect", db, 7, sqltable.Options{}, "dialect"},
		{"injected table", db, sqltable.MySQL, sqltable.Options{Table: "events; drop table x"}, "Options.Table"},
		{"quoted schema", db, sqltable.Postgres, sqltable.Options{Schema: `a"b`}, "Options.Schema"},
		{"backquote", db, sqltable.MySQL, sqltable.Options{Table: "a`b"}, "Options.Table"},
		{"upper case", db, sqltable.SQLite, sqltable.Options{Table: "Events"}, "Options.Table"},
		{"long table", db, sqltable.SQLite, sqltable.Options{Table: strings.Repeat("t", 51)}, "Options.Table"},
		{"negative retention", db, sqltable.SQLite, sqltable.Options{Retention: -1}, "Options.Retention"},
		{"sub-millisecond lease", db, sqltable.SQLite, sqltable.Options{Lease: 1000}, "Options.Lease"},
		{"negative batch", db, sqltable.SQLite, sqltable.Options{CleanupBatch: -1}, "Options.CleanupBatch"},
	}
	for _, c := range cases {
		_, err := sqltable.New(c.db, c.dialect, c.opts)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: New = %v, want an error naming %q", c.name, err, c.want)
		}
	}
}

var _ = url.QueryEscape
