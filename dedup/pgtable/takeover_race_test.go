package pgtable_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestClaimBehindATakeoverSeesTheNewOwner: a key's done row has expired;
// another transaction takes it over (a lease-mode claim, or a Process) and
// holds its row lock. A claim that runs meanwhile waits on that lock; once
// the takeover commits, the claim must answer from the new row (in flight,
// or a duplicate with the new result), never from the expired row its
// statement's snapshot still shows.
func TestClaimBehindATakeoverSeesTheNewOwner(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 8)
	ctx := testenv.Ctx(t)
	for _, tc := range []struct {
		name     string
		takeover string // the new row's token and result
		claim    func(s *pgtable.Store, k dedup.Key) error
		want     func(err error) bool
	}{
		{"lease claim behind a lease takeover", "token = 'other-owner', result = NULL",
			func(s *pgtable.Store, k dedup.Key) error {
				l, err := s.Lease().Claim(ctx, k)
				if err == nil {
					_ = s.Lease().Release(ctx, l)
				}
				return err
			},
			func(err error) bool { return errors.Is(err, dedup.ErrInFlight) }},
		{"transactional claim behind a committed takeover", "token = NULL, result = 'new'",
			func(s *pgtable.Store, k dedup.Key) error {
				return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return s.ClaimTx(ctx, tx, k) })
			},
			func(err error) bool {
				res, ok := dedup.StoredResult(err)
				return ok && string(res) == "new"
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newStore(t, pool, pgtable.Options{Lease: time.Minute})
			k := dedup.NewKey("pay", testenv.UniqueID("order"), nil)
			if _, err := s.Process(ctx, k, func(context.Context, pgx.Tx) ([]byte, error) { return []byte("old"), nil }); err != nil {
				t.Fatal(err)
			}
			if _, err := pool.Exec(ctx, "UPDATE "+s.Table()+" SET expires_at = clock_timestamp() - interval '1 second'"+whereKey, k.Scope, k.ID); err != nil {
				t.Fatal(err)
			}
			taker, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = taker.Rollback(ctx) }()
			if _, err := taker.Exec(ctx, "UPDATE "+s.Table()+" SET "+tc.takeover+
				", expires_at = clock_timestamp() + interval '1 hour'"+whereKey, k.Scope, k.ID); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- tc.claim(s, k) }()
			testenv.Eventually(t, 30*time.Second, "the claim to wait on the takeover's row lock", func() bool {
				var n int
				if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1",
					"%"+s.Table()+"%").Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n > 0
			})
			if err := taker.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if err := <-done; !tc.want(err) {
				t.Fatalf("the claim answered %v", err)
			}
		})
	}
}
