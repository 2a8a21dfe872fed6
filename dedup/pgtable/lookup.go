package pgtable

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

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
	k, _ := s.rowKey(key)
	row, err := scanKeyRow(s.db.QueryRow(ctx, s.sql.lookup, k))
	if err != nil {
		return fmt.Errorf("pgtable: lookup %s: %w", key, err)
	}
	if row == nil || row.expired {
		return nil
	}
	return verdict(key, row.existing)
}

// TxAborted reports whether tx is in a failed state: one of its statements
// failed, so nothing written through it can commit. A middleware that runs
// a handler in Process asks it before storing a response (httpidem).
func (s *Store) TxAborted(tx pgx.Tx) bool {
	conn := tx.Conn()
	return conn != nil && conn.PgConn().TxStatus() == 'E'
}
