package pgtable_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestClaimBatchTx(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 8)
	s := newStore(t, pool, pgtable.Options{})
	ctx := testenv.Ctx(t)
	a := dedup.NewKey("b", "a", []byte("1"))
	b := dedup.NewKey("b", "b", []byte("2"))
	aOther := dedup.NewKey("b", "a", []byte("other"))
	bad := dedup.Key{Scope: "b", ID: ""}

	var res []error
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		res, err = s.ClaimBatchTx(ctx, tx, []dedup.Key{a, b, a, aOther, bad})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if res[0] != nil || res[1] != nil {
		t.Fatalf("new keys: %v %v", res[0], res[1])
	}
	if !errors.Is(res[2], dedup.ErrDuplicate) {
		t.Fatalf("repeat in batch: %v, want ErrDuplicate", res[2])
	}
	if !errors.Is(res[3], dedup.ErrFingerprintMismatch) {
		t.Fatalf("other content in batch: %v, want ErrFingerprintMismatch", res[3])
	}
	if !errors.Is(res[4], dedup.ErrInvalidKey) {
		t.Fatalf("invalid key: %v", res[4])
	}
	// A rolled-back batch leaves nothing behind.
	c := dedup.NewKey("b", "c", nil)
	_ = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := s.ClaimBatchTx(ctx, tx, []dedup.Key{c}); err != nil {
			return err
		}
		return errors.New("rollback")
	})
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		res, err = s.ClaimBatchTx(ctx, tx, []dedup.Key{a, c})
		return err
	})
	if err != nil || !errors.Is(res[0], dedup.ErrDuplicate) || res[1] != nil {
		t.Fatalf("after rollback: %v %v", res, err)
	}
}

// TestClaimBatchTxConcurrentOverlap: batches over overlapping keys, in
// different orders, run concurrently: every key is claimed by exactly one
// committed batch, and no batch deadlocks.
func TestClaimBatchTxConcurrentOverlap(t *testing.T) {
	t.Parallel()
	for _, partitioned := range []bool{false, true} {
		t.Run(fmt.Sprintf("partitioned=%v", partitioned), func(t *testing.T) { testClaimBatchOverlap(t, partitioned) })
	}
}

func testClaimBatchOverlap(t *testing.T, partitioned bool) {
	pool := testenv.Pool(t, 16)
	s := newStore(t, pool, pgtable.Options{Partitioned: partitioned})
	testBatchOverlap(t, pool, s, func(ctx context.Context, keys []dedup.Key) ([]error, error) {
		var res []error
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var err error
			res, err = s.ClaimBatchTx(ctx, tx, keys)
			return err
		})
		return res, err
	})
}

// testBatchOverlap runs batches of overlapping keys through claim, each in
// a transaction that commits, and checks that every key was claimed once.
func testBatchOverlap(t *testing.T, pool *pgxpool.Pool, s *pgtable.Store, claim func(ctx context.Context, keys []dedup.Key) ([]error, error)) {
	ctx := testenv.Ctx(t)
	const workers, keysPer, universe = 8, 200, 500
	var mu sync.Mutex
	wins := map[string]int{}
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			keys := make([]dedup.Key, keysPer)
			for i := range keys {
				keys[i] = dedup.Key{Scope: "o", ID: fmt.Sprint((w*131 + i*7) % universe)}
			}
			if w%2 == 1 { // reverse order for half of them
				for i, j := 0, len(keys)-1; i < j; i, j = i+1, j-1 {
					keys[i], keys[j] = keys[j], keys[i]
				}
			}
			res, err := claim(ctx, keys)
			if err != nil {
				errs <- err
				return
			}
			mu.Lock()
			defer mu.Unlock()
			for i, r := range res {
				switch {
				case r == nil:
					wins[keys[i].ID]++
				case errors.Is(r, dedup.ErrDuplicate):
				default:
					errs <- r
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("batch: %v", err)
	}
	var rows int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+s.Table()).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	for id, n := range wins {
		if n != 1 {
			t.Errorf("key %s won by %d batches", id, n)
		}
	}
	if rows != len(wins) {
		t.Fatalf("%d rows, %d keys won", rows, len(wins))
	}
}
