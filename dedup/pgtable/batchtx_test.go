package pgtable_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// batchLayouts are the store layouts BeginBatch is tested on.
var batchLayouts = []struct {
	name string
	opts pgtable.Options
}{
	{"plain", pgtable.Options{}},
	{"plain/keep_keys/time_ordered", pgtable.Options{KeepKeys: true, TimeOrderedKeys: true}},
	{"partitioned", pgtable.Options{Partitioned: true, PartitionWidth: time.Hour, Retention: 2 * time.Hour}},
}

// v7 returns a UUID of version 7 in text, made at ms milliseconds after the
// epoch, with n in its random part.
func v7(ms int64, n int) string {
	return fmt.Sprintf("%08x-%04x-7%03x-8%03x-%012x", ms>>16, ms&0xffff, n>>12&0xfff, n&0xfff, n)
}

// claimedIn returns the number of rows of s's table.
func claimedIn(t *testing.T, pool *pgxpool.Pool, s *pgtable.Store) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+s.Table()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// beginBatch runs BeginBatch and fails the test on its error.
func beginBatch(t *testing.T, s *pgtable.Store, db pgtable.DB, keys ...dedup.Key) (*pgtable.BatchTx, []error) {
	t.Helper()
	bt, res, err := s.BeginBatch(testenv.Ctx(t), db, keys)
	if err != nil {
		t.Fatalf("BeginBatch: %v", err)
	}
	if len(res) != len(keys) {
		t.Fatalf("BeginBatch returned %d verdicts for %d keys", len(res), len(keys))
	}
	return bt, res
}

// wantVerdicts fails the test unless each verdict matches its sentinel (nil
// for a key claimed first).
func wantVerdicts(t *testing.T, what string, got []error, want ...error) {
	t.Helper()
	for i, w := range want {
		if (w == nil) != (got[i] == nil) || (w != nil && !errors.Is(got[i], w)) {
			t.Fatalf("%s: verdict %d = %v, want %v (all: %v)", what, i, got[i], w, got)
		}
	}
}

// TestBeginBatch: the verdicts of BeginBatch for new keys, keys repeated in
// the batch, invalid keys, keys claimed by an earlier batch, expired rows
// and lease-mode claims; a rollback frees the batch's keys; statements
// queued with AtCommit commit with the claims, and a failing one takes
// them down. In the plain layout, a batch of new keys never needs the
// conflict handling, and a batch with a key that has a row always does.
func TestBeginBatch(t *testing.T) {
	pool := testenv.Pool(t, 8)
	for _, l := range batchLayouts {
		t.Run(l.name, func(t *testing.T) {
			s := newStore(t, pool, l.opts)
			ctx := testenv.Ctx(t)
			plain := !l.opts.Partitioned
			conflicts := func(want int64) {
				t.Helper()
				if got := pgtable.BatchConflicts(s); plain && got != want {
					t.Fatalf("%d batches claimed with the conflict handling, want %d", got, want)
				}
			}
			effects := pgx.Identifier{s.Options().Schema, "effects"}.Sanitize()
			if _, err := pool.Exec(ctx, "CREATE TABLE "+effects+" (id text)"); err != nil {
				t.Fatal(err)
			}
			a := dedup.NewKey("b", v7(1_700_000_000_000, 1), []byte("1"))
			b := dedup.NewKey("b", "b", []byte("2"))
			aOther := dedup.NewKey("b", a.ID, []byte("other"))
			bad := dedup.Key{Scope: "b", ID: ""}

			bt, res := beginBatch(t, s, pool, a, b, a, aOther, bad)
			wantVerdicts(t, "first batch", res, nil, nil, dedup.ErrDuplicate, dedup.ErrFingerprintMismatch, dedup.ErrInvalidKey)
			bt.AtCommit("INSERT INTO "+effects+" (id) VALUES ($1), ($2)", a.ID, b.ID)
			if err := bt.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if err := bt.Rollback(ctx); err != nil {
				t.Fatalf("Rollback after Commit: %v", err)
			}
			conflicts(0)
			if n := claimedIn(t, pool, s); n != 2 {
				t.Fatalf("%d rows after the first batch, want 2", n)
			}

			// A rolled-back batch leaves nothing behind.
			c := dedup.NewKey("b", "c", nil)
			bt, res = beginBatch(t, s, pool, c)
			wantVerdicts(t, "batch rolled back", res, nil)
			if err := bt.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			conflicts(0)

			// a has a row: the conflict handling answers every key.
			d := dedup.NewKey("b", v7(1_700_000_000_001, 2), nil)
			bt, res = beginBatch(t, s, pool, d, a, c, aOther)
			wantVerdicts(t, "batch after the first", res, nil, dedup.ErrDuplicate, nil, dedup.ErrFingerprintMismatch)
			if err := bt.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			conflicts(1)
			if n := claimedIn(t, pool, s); n != 4 {
				t.Fatalf("%d rows, want 4 (a, b, c, d)", n)
			}

			// An expired row is taken over; a live lease is in flight.
			if _, err := pool.Exec(ctx, "UPDATE "+s.Table()+" SET expires_at = clock_timestamp() - interval '1 second' WHERE key = $1::uuid",
				pgtable.RowKey(s, b)); err != nil {
				t.Fatal(err)
			}
			held := dedup.NewKey("b", "held", nil)
			lease, err := s.Lease().Claim(ctx, held)
			if err != nil {
				t.Fatal(err)
			}
			bt, res = beginBatch(t, s, pool, b, held)
			wantVerdicts(t, "batch over an expired row and a lease", res, nil, dedup.ErrInFlight)
			if err := bt.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			conflicts(2)
			if err := s.Lease().Release(ctx, lease); err != nil {
				t.Fatal(err)
			}

			// A statement queued with AtCommit that fails: nothing commits.
			e := dedup.NewKey("b", "e", nil)
			bt, res = beginBatch(t, s, pool, e)
			wantVerdicts(t, "batch whose commit fails", res, nil)
			if _, err := bt.Tx().Exec(ctx, "INSERT INTO "+effects+" (id) VALUES ($1)", e.ID); err != nil {
				t.Fatal(err)
			}
			bt.AtCommit("INSERT INTO " + effects + " (id) VALUES (1/0)")
			if err := bt.Commit(ctx); err == nil || !strings.Contains(err.Error(), "division by zero") {
				t.Fatalf("Commit with a failing statement = %v", err)
			}
			if err := s.Lookup(ctx, e); err != nil {
				t.Fatalf("Lookup of a key whose batch failed to commit = %v, want nil", err)
			}
			var effectRows int
			if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+effects).Scan(&effectRows); err != nil || effectRows != 2 {
				t.Fatalf("%d effects (%v), want the first batch's 2", effectRows, err)
			}
			// The connection went back to the pool clean: the next batch
			// claims e.
			bt, res = beginBatch(t, s, pool, e)
			wantVerdicts(t, "batch after a failed commit", res, nil)
			if err := bt.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestBeginBatchConcurrentDuplicate: a batch that overlaps one still open
// in another transaction waits for it, then sees the overlapping keys as
// duplicates when it committed, or claims them when it rolled back.
func TestBeginBatchConcurrentDuplicate(t *testing.T) {
	pool := testenv.Pool(t, 8)
	for _, l := range batchLayouts {
		for _, commit := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/commit=%v", l.name, commit), func(t *testing.T) {
				s := newStore(t, pool, l.opts)
				ctx := testenv.Ctx(t)
				x, y, z := dedup.NewKey("c", "x", nil), dedup.NewKey("c", v7(1_700_000_000_000, 7), nil), dedup.NewKey("c", "z", nil)
				first, res := beginBatch(t, s, pool, x, y)
				wantVerdicts(t, "first batch", res, nil, nil)
				pid := first.Tx().Conn().PgConn().PID()

				type outcome struct {
					res []error
					err error
				}
				done := make(chan outcome, 1)
				go func() {
					bt, res, err := s.BeginBatch(ctx, pool, []dedup.Key{z, y})
					if err == nil {
						err = bt.Commit(ctx)
					}
					done <- outcome{res, err}
				}()
				testenv.Eventually(t, 30*time.Second, "the second batch to wait for the first", func() bool {
					var n int
					err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY (pg_blocking_pids(pid))", pid).Scan(&n)
					return err == nil && n == 1
				})
				select {
				case o := <-done:
					t.Fatalf("the second batch ended while the first was open: %v, %v", o.res, o.err)
				default:
				}
				end := first.Rollback
				if commit {
					end = first.Commit
				}
				if err := end(ctx); err != nil {
					t.Fatal(err)
				}
				o := <-done
				if o.err != nil {
					t.Fatal(o.err)
				}
				if commit {
					wantVerdicts(t, "second batch after the first committed", o.res, nil, dedup.ErrDuplicate)
				} else {
					wantVerdicts(t, "second batch after the first rolled back", o.res, nil, nil)
				}
				want := 3
				if !commit {
					want = 2
				}
				if n := claimedIn(t, pool, s); n != want {
					t.Fatalf("%d rows, want %d", n, want)
				}
			})
		}
	}
}

// TestBeginBatchOnTx: on a pgx.Tx the batch runs in a savepoint of it: a
// duplicate's unique violation leaves the outer transaction usable, and
// the claims commit with it.
func TestBeginBatchOnTx(t *testing.T) {
	pool := testenv.Pool(t, 4)
	s := newStore(t, pool, pgtable.Options{})
	ctx := testenv.Ctx(t)
	a, b := dedup.NewKey("t", "a", nil), dedup.NewKey("t", "b", nil)
	outer, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = outer.Rollback(ctx) }()
	bt, res := beginBatch(t, s, outer, a)
	wantVerdicts(t, "first batch", res, nil)
	if err := bt.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	bt, res = beginBatch(t, s, outer, b, a)
	wantVerdicts(t, "second batch", res, nil, dedup.ErrDuplicate)
	if err := bt.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := pgtable.BatchConflicts(s); got != 1 {
		t.Fatalf("%d batches claimed with the conflict handling, want 1", got)
	}
	if err := outer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := claimedIn(t, pool, s); n != 2 {
		t.Fatalf("%d rows, want 2", n)
	}
}

// TestBeginBatchConcurrentOverlap: batches over overlapping keys, in
// different orders, run concurrently through BeginBatch: every key is
// claimed by exactly one committed batch, and no batch deadlocks.
func TestBeginBatchConcurrentOverlap(t *testing.T) {
	for _, l := range batchLayouts {
		t.Run(l.name, func(t *testing.T) {
			pool := testenv.Pool(t, 16)
			s := newStore(t, pool, l.opts)
			testBatchOverlap(t, pool, s, func(ctx context.Context, keys []dedup.Key) ([]error, error) {
				bt, res, err := s.BeginBatch(ctx, pool, keys)
				if err != nil {
					return nil, err
				}
				return res, bt.Commit(ctx)
			})
		})
	}
}

// TestTimeOrderedKeys: with Options.TimeOrderedKeys, the row of a UUID of
// version 6 or 7 (either case) is keyed by the id's first 6 bytes and the
// first 10 of the key's digest, any other id by the digest; the SQL form
// of the key (the migrations') agrees with it, and every path finds the
// row a batch claimed.
func TestTimeOrderedKeys(t *testing.T) {
	pool := testenv.Pool(t, 4)
	s := newStore(t, pool, pgtable.Options{TimeOrderedKeys: true})
	ctx := testenv.Ctx(t)
	id := v7(1_700_000_000_000, 42)
	for _, c := range []struct {
		id      string
		ordered bool
	}{
		{id, true},
		{strings.ToUpper(id), true},
		{"1ec9414c-232a-6b00-b3c8-9e6bdeced846", true},  // version 6
		{"9b2e9d2c-1f1e-4d7a-9b4e-2f4f1c8f3a11", false}, // version 4
		{"018bcfe5-6800-7000-8000-00000000002", false},  // one digit short
		{"018bcfe5-6800-7000-8000-00000000002g", false}, // not hexadecimal
		{"order-17", false},
	} {
		k := dedup.Key{Scope: "o", ID: c.id}
		got := pgtable.RowKey(s, k)
		var digest, inSQL string
		if err := pool.QueryRow(ctx, "SELECT ("+pgtable.KeySQL("$1::text", "$2::text")+")::text, ("+
			pgtable.OrderedKeySQL("$1::text", "$2::text")+")::text", k.Scope, k.ID).Scan(&digest, &inSQL); err != nil {
			t.Fatal(err)
		}
		if got != inSQL {
			t.Errorf("%s: the row key is %s in Go, %s in SQL", c.id, got, inSQL)
		}
		hexOf := func(u string) string { return strings.ReplaceAll(u, "-", "") }
		want := digest
		if c.ordered {
			want = strings.ToLower(hexOf(c.id)[:12]) + hexOf(digest)[:20]
		}
		if hexOf(got) != hexOf(want) {
			t.Errorf("%s: row key %s, want %s", c.id, got, want)
		}
		if !strings.Contains(hexOf(got), k.Hash()) {
			t.Errorf("%s: row key %s does not hold the key's hash %s", c.id, got, k.Hash())
		}
	}

	// A batch claims keys of both kinds; every path then finds them.
	keys := []dedup.Key{dedup.NewKey("o", id, []byte("p")), dedup.NewKey("o", "order-17", []byte("p"))}
	bt, res := beginBatch(t, s, pool, keys...)
	wantVerdicts(t, "batch", res, nil, nil)
	if err := bt.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if err := s.Lookup(ctx, k); !errors.Is(err, dedup.ErrDuplicate) {
			t.Errorf("Lookup(%s) = %v, want ErrDuplicate", k.ID, err)
		}
		if _, err := s.Process(ctx, k, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); !errors.Is(err, dedup.ErrDuplicate) {
			t.Errorf("Process(%s) = %v, want ErrDuplicate", k.ID, err)
		}
		if _, err := s.Lease().Claim(ctx, k); !errors.Is(err, dedup.ErrDuplicate) {
			t.Errorf("lease claim of %s = %v, want ErrDuplicate", k.ID, err)
		}
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return s.ClaimTx(ctx, tx, k) })
		if !errors.Is(err, dedup.ErrDuplicate) {
			t.Errorf("ClaimTx(%s) = %v, want ErrDuplicate", k.ID, err)
		}
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+s.Table()+" WHERE key = $1::uuid", pgtable.RowKey(s, k)).Scan(&n); err != nil || n != 1 {
			t.Errorf("rows keyed %s: %d (%v), want 1", pgtable.RowKey(s, k), n, err)
		}
		st, err := s.Inspect(ctx, k)
		if err != nil || st.Status != dedup.KeyDone || st.Digest != k.Digest() {
			t.Errorf("Inspect(%s) = %+v, %v; want a done row, with the key's digest", k.ID, st, err)
		}
		row, err := dedup.ParseDigest(pgtable.RowKey(s, k))
		if err != nil {
			t.Fatal(err)
		}
		if st, err := s.InspectDigest(ctx, row); err != nil || st.Status != dedup.KeyDone {
			t.Errorf("InspectDigest of the key column of %s = %+v, %v; want a done row", k.ID, st, err)
		}
	}
}
