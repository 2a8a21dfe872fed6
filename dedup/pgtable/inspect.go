package pgtable

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/idem/dedup"
)

// Inspect reads what the table holds for key, for an operator ("idem
// dedup show"): the row's state, when it expires and whether that has
// passed, its fingerprint, its result and, when the row keeps them
// (Options.KeepKeys), its scope and id. A key with no row is
// dedup.KeyAbsent. It is InspectDigest of the key's digest; the key is
// not validated (a key no claim accepts has no row).
func (s *Store) Inspect(ctx context.Context, key dedup.Key) (dedup.KeyState, error) {
	return s.InspectDigest(ctx, key.Digest())
}

// InspectDigest is Inspect by the key's digest, the table's key column:
// for a row found by its key when scope and id are not known. It is one
// read of the primary key (of every partition, in the partitioned
// layout), as last committed: it claims nothing and waits for no
// transaction (a claim whose transaction is open is not seen).
func (s *Store) InspectDigest(ctx context.Context, d dedup.Digest) (dedup.KeyState, error) {
	st := dedup.KeyState{Digest: d}
	var (
		leased     bool
		expiresAt  time.Time
		fp, result []byte
		scope, id  *string
	)
	err := s.db.QueryRow(ctx, s.sql.inspect, pgtype.UUID{Bytes: d, Valid: true}).
		Scan(&leased, &expiresAt, &st.Expired, &fp, &result, &scope, &id)
	if errors.Is(err, pgx.ErrNoRows) {
		return st, nil
	}
	if err != nil {
		return dedup.KeyState{}, fmt.Errorf("pgtable: inspect #%s in %s: %w", d.Hash(), s.table, err)
	}
	st.Status = dedup.KeyDone
	if leased {
		st.Status = dedup.KeyInFlight
	}
	st.ExpiresAt = expiresAt
	if st.Fingerprint, err = fingerprintFromBytes(fp); err != nil {
		return dedup.KeyState{}, err
	}
	st.Result = result
	if scope != nil && id != nil {
		st.Scope, st.ID, st.KeysKept = *scope, *id, true
	}
	return st, nil
}
