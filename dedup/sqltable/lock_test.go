package sqltable_test

import (
	"context"
	"database/sql"
	"errors"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// isolationParam is the DSN parameter that sets the session isolation
// level of the test server: transaction_isolation on MySQL 8 and MariaDB
// 11.1+, tx_isolation on older MariaDB.
func isolationParam(t testing.TB, level string) string {
	t.Helper()
	db := testenv.MySQL(t, "")
	name := "transaction_isolation"
	var v string
	if err := db.QueryRowContext(context.Background(), "SELECT @@SESSION.transaction_isolation").Scan(&v); err != nil {
		name = "tx_isolation"
	}
	return name + "=" + url.QueryEscape("'"+level+"'")
}

func backendByName(t testing.TB, name string) backend {
	for _, b := range backends {
		if b.name == name {
			return b
		}
	}
	t.Fatalf("no backend %s", name)
	return backend{}
}

// waitingOnLock reports whether a statement on s's table waits for a
// lock, as the server itself tells (each test has a table of its own).
func waitingOnLock(ctx context.Context, t testing.TB, b backend, db *sql.DB, s *sqltable.Store) bool {
	t.Helper()
	if b.dialect == sqltable.MySQL {
		waits, err := testenv.MySQLLockWaits(ctx, db)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range waits {
			if "`"+w.Table+"`" == s.Table() {
				return true
			}
		}
		return false
	}
	var n int
	err := db.QueryRowContext(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1",
		"%"+s.Table()+"%").Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n > 0
}

// TestDuplicateWaitsOnFirst: while a first Process holds a key, a claim of
// the same key in another transaction waits on the server's lock (the
// server says so), then answers a duplicate with the first's result, or
// wins when the first rolled back: on PostgreSQL through both drivers, and
// on MariaDB at each isolation level the store supports.
func TestDuplicateWaitsOnFirst(t *testing.T) {
	t.Parallel()
	type run struct {
		name, backend, params string
	}
	runs := []run{{"postgres-pgx", "postgres-pgx", ""}, {"postgres-pq", "postgres-pq", ""}}
	for _, level := range []string{"READ-COMMITTED", "REPEATABLE-READ", "SERIALIZABLE"} {
		runs = append(runs, run{"mysql-" + level, "mysql", level})
	}
	for _, r := range runs {
		t.Run(r.name, func(t *testing.T) {
			b := backendByName(t, r.backend)
			db := b.open(t)
			if r.params != "" {
				db = testenv.MySQL(t, isolationParam(t, r.params))
				if got := sessionLevel(t, db); got != r.params {
					t.Fatalf("the session runs at %s, want %s", got, r.params)
				}
			}
			s := newStore(t, b, db, sqltable.Options{})
			for _, firstFails := range []bool{false, true} {
				testWaitsOnFirst(t, b, db, s, firstFails)
			}
		})
	}
}

func sessionLevel(t testing.TB, db *sql.DB) string {
	t.Helper()
	var v string
	err := db.QueryRowContext(context.Background(), "SELECT @@SESSION.transaction_isolation").Scan(&v)
	if err != nil {
		err = db.QueryRowContext(context.Background(), "SELECT @@SESSION.tx_isolation").Scan(&v)
	}
	if err != nil {
		t.Fatal(err)
	}
	return v
}

var errFirst = errors.New("first failed")

func testWaitsOnFirst(t *testing.T, b backend, db *sql.DB, s *sqltable.Store, firstFails bool) {
	ctx := testenv.Ctx(t)
	key := dedup.NewKey("pay", testenv.UniqueID("order"), []byte("100"))
	inFirst, finish := make(chan struct{}), make(chan struct{})
	firstDone := make(chan error, 1)
	go func() {
		_, err := s.Process(ctx, key, func(context.Context, *sql.Tx) ([]byte, error) {
			close(inFirst)
			<-finish
			if firstFails {
				return nil, errFirst
			}
			return []byte("receipt"), nil
		})
		firstDone <- err
	}()
	<-inFirst
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	secondDone := make(chan error, 1)
	go func() { secondDone <- s.ClaimTx(ctx, tx, key) }()
	testenv.Eventually(t, 30*time.Second, "the second claim to wait on the first's lock", func() bool {
		return waitingOnLock(ctx, t, b, db, s)
	})
	select {
	case err := <-secondDone:
		t.Fatalf("the second claim returned %v while the first transaction was open", err)
	default:
	}
	close(finish)
	errA, errB := <-firstDone, <-secondDone
	if firstFails {
		if !errors.Is(errA, errFirst) || errB != nil {
			t.Fatalf("first rolled back: first=%v second=%v; want the second to win", errA, errB)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		return
	}
	if res, ok := dedup.StoredResult(errB); errA != nil || !ok || string(res) != "receipt" {
		t.Fatalf("first committed: first=%v second=%v; want a duplicate with the first's result", errA, errB)
	}
}

// TestIsolationRefused: a MariaDB whose sessions run at READ UNCOMMITTED is
// refused by every kind of claim, before anything runs.
func TestIsolationRefused(t *testing.T) {
	t.Parallel()
	b := backendByName(t, "mysql")
	db := testenv.MySQL(t, isolationParam(t, "READ-UNCOMMITTED"))
	s := newStore(t, b, db, sqltable.Options{})
	ctx := testenv.Ctx(t)
	key := dedup.NewKey("pay", testenv.UniqueID("order"), nil)
	_, err := s.Process(ctx, key, func(context.Context, *sql.Tx) ([]byte, error) {
		t.Error("fn ran at READ UNCOMMITTED")
		return nil, nil
	})
	if !errors.Is(err, sqltable.ErrIsolation) {
		t.Fatalf("Process = %v, want ErrIsolation", err)
	}
	t.Logf("refused with: %v", err)
	if _, err := s.Lease().Claim(ctx, key); !errors.Is(err, sqltable.ErrIsolation) {
		t.Fatalf("Lease().Claim = %v, want ErrIsolation", err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if err := s.ClaimTx(ctx, tx, key); !errors.Is(err, sqltable.ErrIsolation) {
		t.Fatalf("ClaimTx = %v, want ErrIsolation", err)
	}
	var n int
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+s.Table()).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d rows (%v), want none", n, err)
	}
}

// TestDeadlockIsTransient: two transactions claim the same two keys in
// opposite orders. The server breaks the deadlock by failing one of them:
// that claim answers an error wrapping ErrTransient, never a duplicate, and
// the other transaction commits both keys.
func TestDeadlockIsTransient(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"mysql", "postgres-pgx", "postgres-pq"} {
		t.Run(name, func(t *testing.T) {
			b := backendByName(t, name)
			db := b.open(t)
			s := newStore(t, b, db, sqltable.Options{})
			ctx := testenv.Ctx(t)
			k1 := dedup.NewKey("pay", testenv.UniqueID("a"), nil)
			k2 := dedup.NewKey("pay", testenv.UniqueID("b"), nil)
			txs := make([]*sql.Tx, 2)
			for i, k := range []dedup.Key{k1, k2} {
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				defer func() { _ = tx.Rollback() }()
				if err := s.ClaimTx(ctx, tx, k); err != nil {
					t.Fatal(err)
				}
				txs[i] = tx
			}
			errs := make([]error, 2)
			var wg sync.WaitGroup
			for i, k := range []dedup.Key{k2, k1} {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs[i] = s.ClaimTx(ctx, txs[i], k)
					if errs[i] != nil {
						_ = txs[i].Rollback() // the victim ends: the other goes on
					}
				}()
			}
			wg.Wait()
			var victim, winner = -1, -1
			for i, err := range errs {
				if err == nil {
					winner = i
					continue
				}
				victim = i
				if !errors.Is(err, sqltable.ErrTransient) || errors.Is(err, dedup.ErrDuplicate) || errors.Is(err, dedup.ErrInFlight) {
					t.Fatalf("claim %d = %v; want an error wrapping ErrTransient and no dedup sentinel", i, err)
				}
				t.Logf("victim: %v", err)
			}
			if victim < 0 || winner < 0 {
				t.Fatalf("errors %v; want one victim and one winner", errs)
			}
			if err := txs[winner].Commit(); err != nil {
				t.Fatal(err)
			}
			// Both keys are done, claimed by the winner.
			for _, k := range []dedup.Key{k1, k2} {
				if _, err := s.Process(ctx, k, func(context.Context, *sql.Tx) ([]byte, error) { return nil, nil }); !errors.Is(err, dedup.ErrDuplicate) {
					t.Fatalf("after the winner committed: %v, want ErrDuplicate", err)
				}
			}
		})
	}
}

// TestLockWaitTimeoutIsTransient: a claim that waits on a first transaction
// longer than MariaDB's innodb_lock_wait_timeout answers an error wrapping
// ErrTransient, never a duplicate.
func TestLockWaitTimeoutIsTransient(t *testing.T) {
	t.Parallel()
	b := backendByName(t, "mysql")
	db := testenv.MySQL(t, "innodb_lock_wait_timeout=1")
	s := newStore(t, b, db, sqltable.Options{})
	ctx := testenv.Ctx(t)
	key := dedup.NewKey("pay", testenv.UniqueID("order"), nil)
	first, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = first.Rollback() }()
	if err := s.ClaimTx(ctx, first, key); err != nil {
		t.Fatal(err)
	}
	ran := false
	_, err = s.Process(ctx, key, func(context.Context, *sql.Tx) ([]byte, error) { ran = true; return nil, nil })
	if ran || !errors.Is(err, sqltable.ErrTransient) || errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("Process behind a held key = %v (ran %v); want ErrTransient and no run", err, ran)
	}
	t.Logf("timed out with: %v", err)
	if err := first.Rollback(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Process(ctx, key, func(context.Context, *sql.Tx) ([]byte, error) { ran = true; return nil, nil }); err != nil || !ran {
		t.Fatalf("retry after the first rolled back = %v (ran %v), want it to run", err, ran)
	}
}

// TestClaimTxAfterSnapshot: on MariaDB at REPEATABLE READ, a transaction
// whose snapshot was taken before a first transaction committed the key
// still answers the duplicate with its result: the read after the INSERT
// is a locking read, which sees the latest committed row.
func TestClaimTxAfterSnapshot(t *testing.T) {
	t.Parallel()
	b := backendByName(t, "mysql")
	db := testenv.MySQL(t, isolationParam(t, "REPEATABLE-READ"))
	s := newStore(t, b, db, sqltable.Options{})
	ctx := testenv.Ctx(t)
	key := dedup.NewKey("pay", testenv.UniqueID("order"), []byte("1"))
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	var n int
	if err := tx.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+s.Table()).Scan(&n); err != nil { // the snapshot
		t.Fatal(err)
	}
	if _, err := s.Process(ctx, key, func(context.Context, *sql.Tx) ([]byte, error) { return []byte("receipt"), nil }); err != nil {
		t.Fatal(err)
	}
	err = s.ClaimTx(ctx, tx, key)
	if res, ok := dedup.StoredResult(err); !ok || string(res) != "receipt" {
		t.Fatalf("ClaimTx in an older snapshot = %v, want a duplicate with the first's result", err)
	}
}
