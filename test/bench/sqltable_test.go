package bench

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// stmtRecorder records what a database/sql client sends through a
// wrapping driver: BEGIN, COMMIT, ROLLBACK, and each statement the driver
// runs with its arguments, in order.
type stmtRecorder struct {
	mu   sync.Mutex
	sent []string
}

func (r *stmtRecorder) add(query string, args []driver.NamedValue) {
	var b strings.Builder
	b.WriteString(query)
	for _, a := range args {
		switch v := a.Value.(type) {
		case []byte:
			fmt.Fprintf(&b, " | %x", v)
		default:
			fmt.Fprintf(&b, " | %#v", v)
		}
	}
	r.mu.Lock()
	r.sent = append(r.sent, b.String())
	r.mu.Unlock()
}

// take returns what was sent since the last take.
func (r *stmtRecorder) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.sent
	r.sent = nil
	return s
}

type recConnector struct {
	driver.Connector
	rec *stmtRecorder
}

func (c recConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &recConn{inner: conn, rec: c.rec}, nil
}

// recConn forwards to the driver's connection every interface database/sql
// looks for on it (those the driver has), recording on the way.
type recConn struct {
	inner driver.Conn
	rec   *stmtRecorder
}

func (c *recConn) Prepare(query string) (driver.Stmt, error) {
	return c.PrepareContext(context.Background(), query)
}

func (c *recConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	s, err := c.inner.(driver.ConnPrepareContext).PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	return &recStmt{inner: s, query: query, rec: c.rec}, nil
}

func (c *recConn) Close() error { return c.inner.Close() }

func (c *recConn) Begin() (driver.Tx, error) {
	return c.BeginTx(context.Background(), driver.TxOptions{})
}

func (c *recConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	c.rec.add("BEGIN", nil)
	tx, err := c.inner.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return recTx{inner: tx, rec: c.rec}, nil
}

// ExecContext records a statement the driver runs as it is; one it
// prepares (driver.ErrSkip) is recorded by its recStmt.
func (c *recConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	res, err := c.inner.(driver.ExecerContext).ExecContext(ctx, query, args)
	if err != driver.ErrSkip {
		c.rec.add(query, args)
	}
	return res, err
}

func (c *recConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	rows, err := c.inner.(driver.QueryerContext).QueryContext(ctx, query, args)
	if err != driver.ErrSkip {
		c.rec.add(query, args)
	}
	return rows, err
}

func (c *recConn) CheckNamedValue(nv *driver.NamedValue) error {
	return c.inner.(driver.NamedValueChecker).CheckNamedValue(nv)
}

func (c *recConn) ResetSession(ctx context.Context) error {
	if r, ok := c.inner.(driver.SessionResetter); ok {
		return r.ResetSession(ctx)
	}
	return nil
}

func (c *recConn) IsValid() bool {
	v, ok := c.inner.(driver.Validator)
	return !ok || v.IsValid()
}

type recTx struct {
	inner driver.Tx
	rec   *stmtRecorder
}

func (t recTx) Commit() error {
	t.rec.add("COMMIT", nil)
	return t.inner.Commit()
}

func (t recTx) Rollback() error {
	t.rec.add("ROLLBACK", nil)
	return t.inner.Rollback()
}

type recStmt struct {
	inner driver.Stmt
	query string
	rec   *stmtRecorder
}

func (s *recStmt) Close() error  { return s.inner.Close() }
func (s *recStmt) NumInput() int { return s.inner.NumInput() }

func (s *recStmt) Exec(args []driver.Value) (driver.Result, error) {
	return nil, fmt.Errorf("recStmt: Exec without context is not recorded")
}

func (s *recStmt) Query(args []driver.Value) (driver.Rows, error) {
	return nil, fmt.Errorf("recStmt: Query without context is not recorded")
}

func (s *recStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	s.rec.add(s.query, args)
	return s.inner.(driver.StmtExecContext).ExecContext(ctx, args)
}

func (s *recStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	s.rec.add(s.query, args)
	return s.inner.(driver.StmtQueryContext).QueryContext(ctx, args)
}

// TestHandSendsSqltableStatements checks that the by-hand sides of the
// sqltable rows (MariaDB, and PostgreSQL through pgx's stdlib driver) send,
// statement by statement, what sqltable's Process sends for a first
// delivery of the same key whose handler makes the row's INSERT: the same
// statements, in the same order, with the same arguments.
func TestHandSendsSqltableStatements(t *testing.T) {
	t.Run("mysql", func(t *testing.T) {
		testenv.MySQL(t, "") // skips, or fails under CI, when MariaDB is down
		cfg, err := mysql.ParseDSN(testenv.MySQLDSN())
		if err != nil {
			t.Fatal(err)
		}
		c, err := mysql.NewConnector(cfg)
		if err != nil {
			t.Fatal(err)
		}
		table := testenv.Name("idembench_sqlt")
		business := "`" + testenv.Name("idembench_sqlb") + "`"
		checkHandStatements(t, c, sqltable.MySQL, sqltable.Options{Table: table},
			"CREATE TABLE "+business+" (id VARCHAR(64) NOT NULL, payload BLOB) ENGINE = InnoDB",
			"INSERT INTO "+business+" (id, payload) VALUES (?, ?)",
			"DROP TABLE IF EXISTS `"+table+"`, `"+table+"_migrations`, "+business)
	})
	t.Run("postgres", func(t *testing.T) {
		testenv.Pool(t, 1) // skips, or fails under CI, when PostgreSQL is down
		cfg, err := pgx.ParseConfig(testenv.PostgresURL())
		if err != nil {
			t.Fatal(err)
		}
		schema := testenv.Name("idembench_sqlp")
		checkHandStatements(t, stdlib.GetConnector(*cfg), sqltable.Postgres, sqltable.Options{Schema: schema, Table: "claims"},
			"CREATE SCHEMA "+schema+"; CREATE TABLE "+schema+".business (id text NOT NULL, payload bytea)",
			"INSERT INTO "+schema+".business (id, payload) VALUES ($1, $2)",
			"DROP SCHEMA IF EXISTS "+schema+" CASCADE")
	})
}

func checkHandStatements(t *testing.T, c driver.Connector, d sqltable.Dialect, opts sqltable.Options, create, insert, drop string) {
	ctx := testenv.Ctx(t)
	rec := new(stmtRecorder)
	db := sql.OpenDB(recConnector{Connector: c, rec: rec})
	t.Cleanup(func() { _ = db.Close() })
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), drop) })
	for _, stmt := range strings.Split(create, "; ") {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	store, err := sqltable.New(db, d, opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	process := func(id string) error {
		key := dedup.Key{Scope: "bench/sql", ID: id, Fingerprint: dedup.FingerprintOf(payload)}
		_, err := store.Process(ctx, key, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
			_, err := tx.ExecContext(ctx, insert, id, payload)
			return nil, err
		})
		return err
	}
	// A first Process reads the server's isolation level, once per store.
	if err := process("warm"); err != nil {
		t.Fatal(err)
	}
	rec.take()

	if err := process("m1"); err != nil {
		t.Fatal(err)
	}
	idem := rec.take()
	if _, err := db.ExecContext(ctx, "DELETE FROM "+store.Table()); err != nil {
		t.Fatal(err)
	}
	rec.take()
	if err := newHandSQL(db, d, store.Table(), insert).process(ctx, "bench/sql", "m1", payload); err != nil {
		t.Fatal(err)
	}
	hand := rec.take()

	if !slices.Equal(idem, hand) {
		t.Errorf("statements differ:\nsqltable %q\nhand     %q", idem, hand)
	}
	if len(idem) != 4 || idem[0] != "BEGIN" || !strings.HasPrefix(idem[1], "INSERT INTO "+store.Table()) ||
		!strings.HasPrefix(idem[2], insert) || idem[3] != "COMMIT" {
		t.Errorf("sqltable sent %q; want BEGIN, the claim's INSERT, the handler's INSERT, COMMIT", idem)
	}
}
