package sqltable

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

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

// InspectDigest is Inspect by the key's digest, the table's digest column:
// for a row found by its digest when scope and id are not known. It is one
// read of the primary key, without a lock: the row as last committed (on
// MySQL, at the session's isolation level), never waiting for a
// transaction that holds it.
func (s *Store) InspectDigest(ctx context.Context, d dedup.Digest) (dedup.KeyState, error) {
	st := dedup.KeyState{Digest: d}
	var (
		leased, expired int64
		expiresMs       int64
		fp, result      []byte
		scope, id       []byte
	)
	err := s.db.QueryRowContext(ctx, s.sql.inspect, d[:]).Scan(&leased, &expiresMs, &expired, &fp, &result, &scope, &id)
	if errors.Is(err, sql.ErrNoRows) {
		return st, nil
	}
	if err != nil {
		return dedup.KeyState{}, fmt.Errorf("sqltable: inspect #%s in %s: %w", d.Hash(), s.table, err)
	}
	st.Status = dedup.KeyDone
	if leased != 0 {
		st.Status = dedup.KeyInFlight
	}
	st.Expired = expired != 0
	st.ExpiresAt = time.UnixMilli(expiresMs)
	if st.Fingerprint, err = fingerprintFromBytes(fp); err != nil {
		return dedup.KeyState{}, err
	}
	st.Result = result
	if scope != nil && id != nil {
		st.Scope, st.ID, st.KeysKept = string(scope), string(id), true
	}
	return st, nil
}
