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

// TestLookup: Lookup answers from the key's committed row, as a claim
// would, and sees neither an expired row nor a claim whose transaction is
// still open (nor waits for it), in both table layouts.
func TestLookup(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	for _, tc := range []struct {
		name string
		opts pgtable.Options
	}{
		{"plain", pgtable.Options{}},
		{"partitioned", pgtable.Options{Partitioned: true, Retention: 24 * time.Hour}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newStore(t, pool, tc.opts)
			ctx := testenv.Ctx(t)
			key := dedup.NewKey("pay", testenv.UniqueID("l"), []byte("100"))
			if err := s.Lookup(ctx, key); err != nil {
				t.Fatalf("lookup of an absent key = %v, want nil", err)
			}
			// A claim whose transaction is open is not seen.
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.ClaimTx(ctx, tx, key); err != nil {
				t.Fatal(err)
			}
			if err := s.Lookup(ctx, key); err != nil {
				t.Fatalf("lookup of a key claimed in an open transaction = %v, want nil", err)
			}
			if err := s.SetResultTx(ctx, tx, key, []byte("r1")); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			err = s.Lookup(ctx, key)
			if res, ok := dedup.StoredResult(err); !ok || string(res) != "r1" {
				t.Fatalf("lookup of a committed key = %v (%q), want ErrDuplicate with r1", err, res)
			}
			other := key
			other.Fingerprint = dedup.FingerprintOf([]byte("200"))
			if err := s.Lookup(ctx, other); !errors.Is(err, dedup.ErrFingerprintMismatch) {
				t.Fatalf("lookup with another fingerprint = %v, want ErrFingerprintMismatch", err)
			}
			if _, err := pool.Exec(ctx, "UPDATE "+s.Table()+" SET expires_at = clock_timestamp() - interval '1 second'"); err != nil {
				t.Fatal(err)
			}
			if err := s.Lookup(ctx, key); err != nil {
				t.Fatalf("lookup of an expired key = %v, want nil", err)
			}
			leased := dedup.NewKey("pay", testenv.UniqueID("l"), []byte("100"))
			if _, err := s.Lease().Claim(ctx, leased); err != nil {
				t.Fatal(err)
			}
			if err := s.Lookup(ctx, leased); !errors.Is(err, dedup.ErrInFlight) {
				t.Fatalf("lookup of a leased key = %v, want ErrInFlight", err)
			}
			_, err = s.Process(ctx, key, func(context.Context, pgx.Tx) ([]byte, error) { return []byte("r2"), nil })
			if err != nil {
				t.Fatal(err)
			}
			if res, _ := dedup.StoredResult(s.Lookup(ctx, key)); string(res) != "r2" {
				t.Fatalf("lookup after the expired key was processed again = %q, want r2", res)
			}
		})
	}
}
