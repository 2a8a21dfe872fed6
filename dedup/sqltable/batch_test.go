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

// TestClaimBatchTx: a batch claim answers each key what ClaimTx would, in
// order: a first claim, a duplicate of a done key (with its result), a key
// repeated in the batch, a fingerprint mismatch, an invalid key; and the
// claims commit with the transaction.
func TestClaimBatchTx(t *testing.T) {
	t.Parallel()
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			db := b.open(t)
			s := newStore(t, b, db, sqltable.Options{})
			ctx := testenv.Ctx(t)
			done := dedup.NewKey("b", testenv.UniqueID("done"), []byte("1"))
			if _, err := s.Process(ctx, done, func(context.Context, *sql.Tx) ([]byte, error) { return []byte("r1"), nil }); err != nil {
				t.Fatal(err)
			}
			fresh := dedup.NewKey("b", testenv.UniqueID("fresh"), []byte("2"))
			other := dedup.NewKey("b", testenv.UniqueID("other"), []byte("3"))
			mismatch := dedup.NewKey(done.Scope, done.ID, []byte("changed"))
			repeatOther := dedup.NewKey(fresh.Scope, fresh.ID, []byte("changed"))
			keys := []dedup.Key{fresh, done, fresh, mismatch, {Scope: "b", ID: "bad\x00"}, other, repeatOther}
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback() }()
			errs, err := s.ClaimBatchTx(ctx, tx, keys)
			if err != nil {
				t.Fatal(err)
			}
			if errs[0] != nil || errs[5] != nil {
				t.Fatalf("first claims: %v, %v", errs[0], errs[5])
			}
			if res, ok := dedup.StoredResult(errs[1]); !ok || string(res) != "r1" {
				t.Fatalf("done key: %v, want a duplicate with r1", errs[1])
			}
			if !errors.Is(errs[2], dedup.ErrDuplicate) {
				t.Fatalf("repeated key: %v, want ErrDuplicate", errs[2])
			}
			if !errors.Is(errs[3], dedup.ErrFingerprintMismatch) || !errors.Is(errs[6], dedup.ErrFingerprintMismatch) {
				t.Fatalf("other content: %v, %v; want ErrFingerprintMismatch", errs[3], errs[6])
			}
			if !errors.Is(errs[4], dedup.ErrInvalidKey) {
				t.Fatalf("invalid key: %v", errs[4])
			}
			if err := s.SetResultTx(ctx, tx, fresh, []byte("r2")); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			_, err = s.Process(ctx, fresh, func(context.Context, *sql.Tx) ([]byte, error) { return nil, nil })
			if res, ok := dedup.StoredResult(err); !ok || string(res) != "r2" {
				t.Fatalf("after commit: %v, want a duplicate with r2", err)
			}
			if _, err := s.Process(ctx, other, func(context.Context, *sql.Tx) ([]byte, error) { return nil, nil }); !errors.Is(err, dedup.ErrDuplicate) {
				t.Fatalf("after commit: %v, want ErrDuplicate", err)
			}
		})
	}
}
