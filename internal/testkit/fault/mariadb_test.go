//go:build unix

package fault_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	_ "github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func startMariaDB(t *testing.T) *fault.MariaDB {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	m, err := fault.StartMariaDB(ctx, fault.MariaDBOptions{})
	if err != nil {
		if strings.Contains(err.Error(), "not found") {
			testenv.Unavailable(t, err.Error())
		}
		t.Fatal(err)
	}
	t.Cleanup(func() {
		dir := m.Dir()
		if err := m.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the server's directory %s is still there after Close: %v", dir, err)
		}
	})
	return m
}

// A committed row survives a SIGKILL (InnoDB crash recovery on Start), an
// uncommitted one does not; the server refuses connections while killed and
// comes back on the same DSN; it is not the shared server.
func TestMariaDBKillAndRecover(t *testing.T) {
	m := startMariaDB(t)
	if strings.Contains(m.DSN(), ":3306)") {
		t.Fatalf("DSN %s is the shared server's port", m.DSN())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	db, err := sql.Open("mysql", m.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = db.Close() }()
	for _, q := range []string{
		"CREATE DATABASE d",
		"CREATE TABLE d.t (v int) ENGINE=InnoDB",
		"INSERT INTO d.t VALUES (1)",
	} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	var datadir string
	if err := db.QueryRowContext(ctx, "SELECT @@datadir").Scan(&datadir); err != nil || !strings.HasPrefix(datadir, m.Dir()) {
		t.Fatalf("datadir = %q, %v; want one under %s", datadir, err, m.Dir())
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.ExecContext(ctx, "INSERT INTO d.t VALUES (2)"); err != nil {
		t.Fatal(err)
	}
	if err := m.Kill(); err != nil {
		t.Fatal(err)
	}
	if m.Running() {
		t.Fatal("Running after Kill")
	}
	if err := tx.Commit(); err == nil {
		t.Fatal("commit on a killed server succeeded")
	}
	if err := db.PingContext(ctx); err == nil {
		t.Fatal("reached a killed server")
	}
	if err := m.Kill(); err != nil {
		t.Fatalf("second Kill: %v", err)
	}
	if err := m.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := m.Start(ctx); err == nil {
		t.Fatal("Start of a running server succeeded")
	}
	var n, sum int
	if err := db.QueryRowContext(ctx, "SELECT count(*), coalesce(sum(v), 0) FROM d.t").Scan(&n, &sum); err != nil {
		t.Fatal(err)
	}
	if n != 1 || sum != 1 {
		t.Fatalf("after recovery: %d rows summing to %d, want the committed row only", n, sum)
	}
	var flush int
	if err := db.QueryRowContext(ctx, "SELECT @@innodb_flush_log_at_trx_commit").Scan(&flush); err != nil || flush != 1 {
		t.Fatalf("innodb_flush_log_at_trx_commit = %d, %v", flush, err)
	}
}
