package memstore

// Token returns the token the store hands out with lease number seq.
func (s *Store) Token(seq uint64) string { return s.token(seq) }

// Sweep removes the expired keys now, as the sweeper does.
func (s *Store) Sweep() { s.sweepOnce() }
