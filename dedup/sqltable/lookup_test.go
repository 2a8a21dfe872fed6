package sqltable_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestLookup: Lookup answers from the key's committed row, as a claim
// would, and sees neither an expired row nor a claim whose transaction is
// still open (nor waits for it), on every driver.
func TestLookup(t *testing.T) {
	t.Parallel()
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			db := b.open(t)
			s := newStore(t, b, db, sqltable.Options{})
			ctx := testenv.Ctx(t)
			key := dedup.NewKey("pay", testenv.UniqueID("l"), []byte("100"))
			if err := s.Lookup(ctx, key); err != nil {
				t.Fatalf("lookup of an absent key = %v, want nil", err)
			}
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.ClaimTx(ctx, tx, key); err != nil {
				t.Fatal(err)
			}
			if err := s.SetResultTx(ctx, tx, key, []byte("r1")); err != nil {
				t.Fatal(err)
			}
			// SQLite has one writer and readers of the last commit (WAL):
			// the read does not wait either.
			if err := s.Lookup(ctx, key); err != nil {
				t.Fatalf("lookup of a key claimed in an open transaction = %v, want nil", err)
			}
			if err := tx.Commit(); err != nil {
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
			if _, err := db.ExecContext(ctx, "UPDATE "+s.Table()+" SET expires_at = "+b.past); err != nil {
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
			_, err = s.Process(ctx, key, func(context.Context, *sql.Tx) ([]byte, error) { return []byte("r2"), nil })
			if err != nil {
				t.Fatal(err)
			}
			if res, _ := dedup.StoredResult(s.Lookup(ctx, key)); string(res) != "r2" {
				t.Fatalf("lookup after the expired key was processed again = %q, want r2", res)
			}
		})
	}
	t.Run("down", func(t *testing.T) {
		for _, b := range backends {
			s := downStore(t, b)
			err := s.Lookup(testenv.Ctx(t), dedup.NewKey("pay", "x", nil))
			if err == nil || errors.Is(err, dedup.ErrDuplicate) || errors.Is(err, dedup.ErrInFlight) {
				t.Fatalf("%s: lookup on a store that is down = %v, want the database's error", b.name, err)
			}
		}
	})
}
