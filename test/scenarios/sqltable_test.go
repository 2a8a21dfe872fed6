package scenarios_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // PostgreSQL through database/sql
	_ "modernc.org/sqlite"             // the SQLite driver of the sqltable scenarios

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// The scenarios on dedup/sqltable: PostgreSQL through database/sql (pgx's
// stdlib driver) and MariaDB (two instances each, each with its own
// *sql.DB) and SQLite (two *sql.DB on one database file). The charges
// table lives in the same database, written in the claim's transaction.
func init() {
	backends = append(backends,
		backend{name: "sqltable_postgres", own: func(t *testing.T) (payments, payments, oracle) {
			testenv.Pool(t, 1) // skips, or fails under CI, when PostgreSQL is down
			open := func() *sql.DB {
				db, err := sql.Open("pgx", testenv.PostgresURL())
				if err != nil {
					t.Fatal(err)
				}
				db.SetMaxOpenConns(20)
				t.Cleanup(func() { _ = db.Close() })
				return db
			}
			admin := open()
			table, charges := testenv.Name("pe"), testenv.Name("charges")
			o := newSQLCharges(t, admin, sqltable.Postgres, charges)
			t.Cleanup(func() {
				_, _ = admin.ExecContext(context.Background(), `DROP TABLE IF EXISTS "`+table+`", "`+table+`_migrations", "`+charges+`"`)
			})
			a := &sqlPayments{sqlStore(t, open(), sqltable.Postgres, table), o}
			b := &sqlPayments{sqlStore(t, open(), sqltable.Postgres, table), o}
			return a, b, o
		}},
		backend{name: "sqltable_mysql", own: func(t *testing.T) (payments, payments, oracle) {
			table := testenv.Name("pe")
			o := newSQLCharges(t, testenv.MySQL(t, ""), sqltable.MySQL, testenv.Name("charges"))
			mk := func() payments {
				db := testenv.MySQL(t, "")
				db.SetMaxOpenConns(20)
				return &sqlPayments{sqlStore(t, db, sqltable.MySQL, table), o}
			}
			t.Cleanup(func() {
				_, _ = o.db.ExecContext(context.Background(), "DROP TABLE IF EXISTS `"+table+"`, `"+table+"_migrations`")
			})
			return mk(), mk(), o
		}},
		backend{name: "sqltable_sqlite", own: func(t *testing.T) (payments, payments, oracle) {
			dsn := "file:" + filepath.Join(t.TempDir(), "pay.db") + "?_txlock=immediate&_pragma=busy_timeout(30000)&_pragma=journal_mode(WAL)"
			open := func() *sql.DB {
				db, err := sql.Open("sqlite", dsn)
				if err != nil {
					t.Fatal(err)
				}
				db.SetMaxOpenConns(8)
				t.Cleanup(func() { _ = db.Close() })
				return db
			}
			o := newSQLCharges(t, open(), sqltable.SQLite, "charges")
			a := &sqlPayments{sqlStore(t, open(), sqltable.SQLite, ""), o}
			b := &sqlPayments{sqlStore(t, open(), sqltable.SQLite, ""), o}
			return a, b, o
		}},
	)
}

func sqlStore(t *testing.T, db *sql.DB, d sqltable.Dialect, table string) *sqltable.Store {
	s, err := sqltable.New(db, d, sqltable.Options{Table: table, Lease: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s
}

// sqlCharges is testenv.Charges on database/sql: a charges table with no
// unique constraint.
type sqlCharges struct {
	db      *sql.DB
	dialect sqltable.Dialect
	table   string
}

func newSQLCharges(t *testing.T, db *sql.DB, d sqltable.Dialect, name string) *sqlCharges {
	o := &sqlCharges{db: db, dialect: d, table: d.Quote(name)}
	if _, err := db.ExecContext(context.Background(), "CREATE TABLE "+o.table+
		" (payment_id VARCHAR(100) NOT NULL, receipt VARCHAR(100) NOT NULL, amount BIGINT NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	if d == sqltable.MySQL {
		t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+o.table) })
	}
	return o
}

func (o *sqlCharges) insert() string {
	return o.dialect.Rebind("INSERT INTO " + o.table + " (payment_id, receipt, amount) VALUES (?, ?, ?)")
}

// Check fails the test unless every payment in want was charged exactly
// once, nothing else was charged, and every answer in seen carries its
// payment's receipt.
func (o *sqlCharges) Check(t testing.TB, want []string, seen map[string][]string) {
	t.Helper()
	rows, err := o.db.QueryContext(context.Background(), "SELECT payment_id, COUNT(*), MIN(receipt) FROM "+o.table+" GROUP BY payment_id")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rows.Close() }()
	type agg struct {
		n       int64
		receipt string
	}
	got := map[string]agg{}
	for rows.Next() {
		var id, rc string
		var n int64
		if err := rows.Scan(&id, &n, &rc); err != nil {
			t.Fatal(err)
		}
		got[id] = agg{n, rc}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	var extra, lost, wrong int
	for _, p := range want {
		a, ok := got[p]
		switch {
		case !ok:
			lost++
		case a.n > 1:
			extra += int(a.n - 1)
		}
		for _, r := range seen[p] {
			if r != a.receipt {
				wrong++
			}
		}
		delete(got, p)
	}
	if extra != 0 || lost != 0 || len(got) != 0 || wrong != 0 {
		t.Fatalf("oracle: %d payments, %d extra charges, %d lost, %d unexpected, %d answers with another receipt",
			len(want), extra, lost, len(got), wrong)
	}
	t.Logf("oracle: %d payments, 0 extra charges, 0 lost, every answer carries its charge's receipt", len(want))
}

// sqlPayments charges inside the transaction that holds the claim, on
// sqltable.
type sqlPayments struct {
	store *sqltable.Store
	o     *sqlCharges
}

func (p *sqlPayments) charge(ctx context.Context, id string, amount int64, gateway time.Duration) (string, error) {
	key := dedup.NewKey("payments/charge", id, []byte(fmt.Sprint(amount)))
	for {
		res, err := p.store.Process(ctx, key, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
			r := testenv.Receipt()
			if _, err := tx.ExecContext(ctx, p.o.insert(), id, r, amount); err != nil {
				return nil, err
			}
			if err := sleepCtx(ctx, gateway); err != nil { // a slow gateway
				return nil, err
			}
			return []byte(r), nil
		})
		if stored, dup := dedup.StoredResult(err); dup {
			return string(stored), nil
		}
		if errors.Is(err, sqltable.ErrTransient) { // the server asks for a new attempt
			continue
		}
		return string(res), err
	}
}

// sqlHandler is the consumer pipeline's handler of the queue scenario on
// sqltable.
func sqlHandler(t *testing.T, p *sqlPayments, mp *telemetrytest.Metrics, midTxCrashes *atomic.Int64) consumer.Handler {
	h, err := consumer.Transactional(p.store, consumer.TxOptions{Scope: "payments/charge", Telemetry: consumer.Telemetry{MeterProvider: mp}},
		func(ctx context.Context, tx *sql.Tx, msg *consumer.Message) error {
			r := testenv.Receipt()
			if _, err := tx.ExecContext(ctx, p.o.insert(), msg.ID, r, 100); err != nil {
				return err
			}
			if chance(0.2) { // crash after the effect, before commit
				midTxCrashes.Add(1)
				return errors.New("worker crashed before commit")
			}
			consumer.SetResult(ctx, []byte(r))
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	return h
}
