package sqltable

import (
	"context"
	"database/sql"
	"errors"

	"github.com/idemkit/idem/dedup"
)

// Lookup reads key's row as it was last committed, without claiming the
// key and without waiting for a transaction that holds it. It returns nil
// when the key has no live row (none, or an expired one; a claim in a
// transaction that has not committed is not seen), else the error a claim
// would answer with: dedup.ErrDuplicate (with the stored result, see
// dedup.StoredResult), dedup.ErrInFlight (a lease-mode claim holds the key)
// or dedup.ErrFingerprintMismatch. Any other error is the database's.
//
// It is one read of the key's primary key, for a cache in front of the
// store to check an answer it is not sure of (dedup/twolevel).
func (s *Store) Lookup(ctx context.Context, key dedup.Key) error {
	if err := s.validate(key); err != nil {
		return err
	}
	var (
		e       existing
		expired int64
	)
	err := s.db.QueryRowContext(ctx, s.sql.peek, keyDigest(key.Scope, key.ID)).
		Scan(&e.state, &e.fp, &e.result, &e.leaseMs, &expired)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil
	case err != nil:
		return s.wrap("lookup", key, err)
	case expired != 0:
		return nil
	}
	return verdict(key, e)
}
