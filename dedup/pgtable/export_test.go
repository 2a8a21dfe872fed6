package pgtable

// LockSeed is the seed of s's key lock hash (keyHashSQL), for tests that
// check the advisory lock Process takes.
func LockSeed(s *Store) int64 { return s.seed }
