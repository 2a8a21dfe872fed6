package pgtable

import "time"

// LockSeed is the seed of s's key locks (keyLock), for tests that check the
// advisory lock Process takes.
func LockSeed(s *Store) int64 { return s.seed }

// KeySQL is the SQL expression of the digest of the text expressions scope
// and id: a row's key.
func KeySQL(scope, id string) string { return keySQL(scope, id) }

// CleanupStatement returns the statement one batch of Cleanup runs in the
// plain layout and its arguments for a cutoff, for tests that check its plan.
func CleanupStatement(s *Store, cutoff time.Time) (string, []any) {
	return s.sql.cleanup, []any{s.opts.CleanupBatch, cutoff}
}
