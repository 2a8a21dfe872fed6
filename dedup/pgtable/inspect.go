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
// dedup.KeyAbsent. It reads the key's row by its row key (the key's
// digest, or with Options.TimeOrderedKeys the time-ordered form of a
// UUIDv6/v7 id) as InspectDigest does; the key is not validated (a key no
// claim accepts has no row).
func (s *Store) Inspect(ctx context.Context, key dedup.Key) (dedup.KeyState, error) {
	row, _ := s.rowKey(key)
	st, err := s.InspectDigest(ctx, dedup.Digest(row.Bytes))
	st.Digest = key.Digest()
	return st, err
}

// InspectDigest is Inspect by the table's key column, the key's digest (or,
// with Options.TimeOrderedKeys and an id that is a UUID of version 6 or 7,
// the time-ordered form of the row key: give the key column as it reads):
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
