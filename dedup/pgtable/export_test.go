package pgtable

import (
	"time"

	"github.com/idemkit/idem/dedup"
)

// LockSeed is the seed of s's key locks (keyLock), for tests that check the
// advisory lock Process takes.
func LockSeed(s *Store) int64 { return s.seed }

// KeySQL is the SQL expression of the digest of the text expressions scope
// and id: a row's key.
func KeySQL(scope, id string) string { return keySQL(scope, id, false) }

// OrderedKeySQL is KeySQL of a store with Options.TimeOrderedKeys.
func OrderedKeySQL(scope, id string) string { return keySQL(scope, id, true) }

// RowKey is the primary key of key's row in s's table, as a uuid string.
func RowKey(s *Store, key dedup.Key) string {
	row, _ := s.rowKey(key)
	return row.String()
}

// CleanupStatement returns the statement one batch of Cleanup runs in the
// plain layout and its arguments for a cutoff, for tests that check its plan.
func CleanupStatement(s *Store, cutoff time.Time) (string, []any) {
	return s.sql.cleanup, []any{s.opts.CleanupBatch, cutoff}
}

// BatchConflicts is the number of batches s's BeginBatch claimed again with
// the conflict handling of ClaimBatchTx, after a key of the batch had a row.
func BatchConflicts(s *Store) int64 { return s.batchConflicts.Load() }
