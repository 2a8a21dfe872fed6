package pgtable_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// lockWaiter returns the pid of a backend other than the excluded ones whose
// current statement mentions schema and that waits for a lock, or 0.
func lockWaiter(t testing.TB, pool *pgxpool.Pool, schema string, exclude ...int32) int32 {
	t.Helper()
	var pid int32
	err := pool.QueryRow(context.Background(), `SELECT pid FROM pg_stat_activity
		WHERE strpos(query, $1) > 0 AND wait_event_type = 'Lock' AND pid <> pg_backend_pid() AND pid <> ALL(coalesce($2, ARRAY[]::int4[]))
		LIMIT 1`, `"`+schema+`"`, exclude).Scan(&pid)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// blocked reports whether backend pid waits for a lock held by another.
func blocked(t testing.TB, pool *pgxpool.Pool, pid int32) bool {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT cardinality(pg_blocking_pids($1))", pid).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n > 0
}

// until polls cond until it holds or done is closed; it reports whether
// cond held first.
func until(done <-chan struct{}, cond func() bool) bool {
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for {
		if cond() {
			return true
		}
		select {
		case <-done:
			return cond()
		case <-tick.C:
		}
	}
}

// holdClaim claims key in a transaction it leaves open, as a long handler
// does, and returns the transaction.
func holdClaim(t testing.TB, pool *pgxpool.Pool, s *pgtable.Store, id string) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	if err := s.ClaimTx(ctx, tx, dedup.Key{Scope: "s", ID: id}); err != nil {
		t.Fatal(err)
	}
	return tx
}

// claimDoesNotWait starts a claim of a new key in a transaction of its own
// and fails the test if the claim waits for a lock. It returns the open
// transaction once the claim is done. held is the long transaction, rolled
// back at the end before the claim is waited for.
func claimDoesNotWait(t *testing.T, pool *pgxpool.Pool, s *pgtable.Store, held pgx.Tx, id string) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	var pid int32
	if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	var claimErr error
	go func() {
		defer close(done)
		claimErr = s.ClaimTx(ctx, tx, dedup.Key{Scope: "s", ID: id})
	}()
	t.Cleanup(func() {
		_ = held.Rollback(ctx)
		<-done
	})
	if until(done, func() bool { return blocked(t, pool, pid) }) {
		t.Fatalf("a claim of key %q waits for a lock while partition maintenance runs", id)
	}
	if claimErr != nil {
		t.Fatal(claimErr)
	}
	return tx
}

// TestPartitionedCleanupNeverMakesClaimsWait: with a claim transaction held
// open (a long handler), Cleanup's detach waits for that transaction while
// a new claim goes through without waiting; when the old transaction ends,
// Cleanup drops the partition.
func TestPartitionedCleanupNeverMakesClaimsWait(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	s := newStore(t, pool, pgtable.Options{Partitioned: true, Retention: 24 * time.Hour, PartitionLockTimeout: time.Hour, KeepKeys: true})
	ctx := testenv.Ctx(t)
	day := time.Now().UTC().AddDate(0, 0, -1)
	addPastPartition(t, pool, s, day.Format("20060102"), day.Format(time.DateOnly), day.AddDate(0, 0, 1).Format(time.DateOnly), 5)
	long := holdClaim(t, pool, s, "long")

	type result struct {
		n   int64
		err error
	}
	res := make(chan result, 1)
	cleanupDone := make(chan struct{})
	go func() {
		defer close(cleanupDone)
		n, err := s.Cleanup(ctx)
		res <- result{n, err}
	}()
	t.Cleanup(func() {
		_ = long.Rollback(context.Background())
		<-cleanupDone
	})
	var waiter int32
	if !until(cleanupDone, func() bool { waiter = lockWaiter(t, pool, s.Options().Schema); return waiter != 0 }) {
		r := <-res
		t.Fatalf("Cleanup returned (%d, %v) while a transaction that read the partition was open", r.n, r.err)
	}
	// Retention waits for the long transaction; a new claim does not.
	newer := claimDoesNotWait(t, pool, s, long, "new")
	select {
	case r := <-res:
		t.Fatalf("Cleanup returned (%d, %v) while a transaction that read the partition was open", r.n, r.err)
	default:
	}
	if lockWaiter(t, pool, s.Options().Schema) != waiter {
		t.Fatal("Cleanup no longer waits for the long transaction, yet it has not returned")
	}
	if err := newer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := long.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil || r.n != 5 {
		t.Fatalf("Cleanup = %d, %v; want the 5 rows of the past partition dropped", r.n, r.err)
	}
	old := "processed_events_p" + day.Format("20060102")
	for _, p := range partitionNames(t, pool, s) {
		if p == old {
			t.Fatalf("partition %s still attached", old)
		}
	}
	var left []string
	rows, err := pool.Query(ctx, "SELECT id FROM "+s.Table()+" ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	if left, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil || strings.Join(left, ",") != "long,new" {
		t.Fatalf("rows left %v (%v), want the keys long and new", left, err)
	}
}

// TestPartitionedCleanupFinishesInterruptedDetach: a detach that runs out
// of PartitionLockTimeout behind a long transaction makes Cleanup return
// while that transaction is still open, with the partition pending detach;
// a Cleanup after it ends finishes the detach and drops the table.
func TestPartitionedCleanupFinishesInterruptedDetach(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	s := newStore(t, pool, pgtable.Options{Partitioned: true, Retention: 24 * time.Hour, PartitionLockTimeout: 20 * time.Millisecond})
	ctx := testenv.Ctx(t)
	day := time.Now().UTC().AddDate(0, 0, -1)
	name := "processed_events_p" + day.Format("20060102")
	addPastPartition(t, pool, s, day.Format("20060102"), day.Format(time.DateOnly), day.AddDate(0, 0, 1).Format(time.DateOnly), 5)
	long := holdClaim(t, pool, s, "long")
	pending := func() (attached, pending bool) {
		t.Helper()
		err := pool.QueryRow(ctx, `SELECT true, inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass($1)`,
			`"`+s.Options().Schema+`".`+name).Scan(&attached, &pending)
		if errors.Is(err, pgx.ErrNoRows) {
			return false, false
		}
		if err != nil {
			t.Fatal(err)
		}
		return attached, pending
	}
	// Returns although the long transaction is open.
	if n, err := s.Cleanup(ctx); err != nil || n != 0 {
		t.Fatalf("Cleanup behind a long transaction = %d, %v; want 0 and no error (retried later)", n, err)
	}
	if a, p := pending(); !a || !p {
		t.Fatalf("partition attached %v, pending detach %v; want a pending detach", a, p)
	}
	if err := claimDoesNotWait(t, pool, s, long, "new").Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// Again while it is open: FINALIZE runs out of time as well.
	if n, err := s.Cleanup(ctx); err != nil || n != 0 {
		t.Fatalf("second Cleanup behind a long transaction = %d, %v; want 0 and no error", n, err)
	}
	if err := long.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// A Cleanup after it finishes the detach. On a shared server, the
	// FINALIZE may also run out of PartitionLockTimeout behind other
	// sessions' transactions; that Cleanup returns 0 and a later one
	// finishes.
	var dropped int64
	testenv.Eventually(t, 30*time.Second, "a Cleanup to finish the detach", func() bool {
		n, err := s.Cleanup(ctx)
		if err != nil {
			t.Fatalf("Cleanup after the long transaction: %v", err)
		}
		dropped += n
		return dropped != 0
	})
	if dropped != 5 {
		t.Fatalf("Cleanup after the long transaction dropped %d rows; want the 5 rows of the partition", dropped)
	}
	if a, _ := pending(); a {
		t.Fatal("partition still attached")
	}
	var exists bool
	if err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", `"`+s.Options().Schema+`".`+name).Scan(&exists); err != nil || exists {
		t.Fatalf("detached partition table exists %v (%v), want it dropped", exists, err)
	}
}

// TestEnsurePartitionsNeverMakesClaimsWait: creating a missing partition
// while a claim transaction is held open neither waits for it nor makes a
// new claim wait.
func TestEnsurePartitionsNeverMakesClaimsWait(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	s := newStore(t, pool, pgtable.Options{Partitioned: true, Retention: 24 * time.Hour, PartitionLockTimeout: time.Hour})
	ctx := testenv.Ctx(t)
	parts := partitionNames(t, pool, s)
	last := parts[len(parts)-1]
	if _, err := pool.Exec(ctx, `DROP TABLE "`+s.Options().Schema+`".`+last); err != nil {
		t.Fatal(err)
	}
	long := holdClaim(t, pool, s, "long")
	done := make(chan struct{})
	var err error
	go func() {
		defer close(done)
		err = s.EnsurePartitions(ctx)
	}()
	t.Cleanup(func() {
		_ = long.Rollback(context.Background())
		<-done
	})
	if until(done, func() bool { return lockWaiter(t, pool, s.Options().Schema) != 0 }) {
		t.Fatal("EnsurePartitions waits for a lock behind a claim transaction")
	}
	if err != nil {
		t.Fatal(err)
	}
	claimDoesNotWait(t, pool, s, long, "new")
	if got := partitionNames(t, pool, s); len(got) != len(parts) || got[len(got)-1] != last {
		t.Fatalf("partitions %v, want %v back", got, parts)
	}
}
