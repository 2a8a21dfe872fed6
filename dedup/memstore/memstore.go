// Package memstore is an in-memory dedup.LeaseStore for examples, tests and
// the embedded demo. It has the same semantics as dedup/redisnx, including
// ErrLeaseLost for a stale owner, and takes an injectable clock so lease and
// retention expiry can be tested without sleeping.
//
// Marks live in the process: a restart forgets them. Use dedup/pgtable for
// anything that must survive one.
//
// The store is a map behind one mutex, and a sweeper goroutine that removes
// expired entries every Options.SweepInterval; Close stops it.
package memstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/idemkit/idem/dedup"
)

// Options configure a Store. The zero value is usable.
type Options struct {
	// Lease is how long a claim is held without Extend. Defaults to 30s.
	Lease time.Duration
	// TTL is how long a completed key is remembered. Defaults to 24h.
	TTL time.Duration
	// MaxKeyLen limits scope and id, in bytes. Defaults to
	// dedup.DefaultMaxKeyLen.
	MaxKeyLen int
	// Clock tells the time. Defaults to the wall clock (time.Now).
	Clock dedup.Clock
	// SweepInterval is how often expired entries are removed in the
	// background. Defaults to one minute; negative disables the sweeper
	// (expired entries are then removed only when their key is touched).
	SweepInterval time.Duration
}

// mapKey is a key without its fingerprint.
type mapKey struct{ scope, id string }

// entry is a key's mark: in flight under token until expires, or done (token
// empty) and remembered until expires.
type entry struct {
	token   string
	expires time.Time
	fp      dedup.Fingerprint
	result  []byte
}

func (e *entry) done() bool { return e.token == "" }

// Store is an in-memory LeaseStore. It is safe for concurrent use. Close stops
// its sweeper.
type Store struct {
	opts Options

	mu      sync.Mutex
	entries map[mapKey]*entry
	closed  bool
	seq     uint64

	tokenPrefix string
	stop        chan struct{}
	wg          sync.WaitGroup
}

var (
	_ dedup.LeaseStore      = (*Store)(nil)
	_ dedup.BatchLeaseStore = (*Store)(nil)
)

// New returns a Store. It returns an error for negative durations.
func New(opts Options) (*Store, error) {
	if opts.Lease < 0 {
		return nil, fmt.Errorf("memstore: Options.Lease is %v; it must be positive (or zero for the 30s default)", opts.Lease)
	}
	if opts.TTL < 0 {
		return nil, fmt.Errorf("memstore: Options.TTL is %v; it must be positive (or zero for the 24h default)", opts.TTL)
	}
	if opts.Lease == 0 {
		opts.Lease = 30 * time.Second
	}
	if opts.TTL == 0 {
		opts.TTL = 24 * time.Hour
	}
	if opts.MaxKeyLen <= 0 {
		opts.MaxKeyLen = dedup.DefaultMaxKeyLen
	}
	if opts.Clock == nil {
		opts.Clock = wallClock{}
	}
	if opts.SweepInterval == 0 {
		opts.SweepInterval = time.Minute
	}
	var p [8]byte
	_, _ = rand.Read(p[:])
	s := &Store{opts: opts, entries: make(map[mapKey]*entry), stop: make(chan struct{}),
		tokenPrefix: hex.EncodeToString(p[:]) + "-"}
	if opts.SweepInterval > 0 {
		s.wg.Add(1)
		go s.sweep()
	}
	return s, nil
}

// Close stops the sweeper, forgets every mark and makes every later call
// return dedup.ErrClosed. It is safe to call more than once.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.entries = nil
	s.mu.Unlock()
	close(s.stop)
	s.wg.Wait()
	return nil
}

// Len returns the number of entries held in memory, including expired ones
// the sweeper has not removed yet.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.entries)
}

func (s *Store) sweep() {
	defer s.wg.Done()
	t := time.NewTicker(s.opts.SweepInterval)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
			now := s.opts.Clock.Now()
			s.mu.Lock()
			for k, e := range s.entries {
				if !now.Before(e.expires) {
					delete(s.entries, k)
				}
			}
			s.mu.Unlock()
		}
	}
}

// Claim implements dedup.LeaseStore.
func (s *Store) Claim(ctx context.Context, key dedup.Key) (*dedup.Lease, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := dedup.ValidateKey(key, s.opts.MaxKeyLen); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, dedup.ErrClosed
	}
	return s.claimLocked(key, s.opts.Clock.Now())
}

// claimLocked claims key at now; the caller holds s.mu.
func (s *Store) claimLocked(key dedup.Key, now time.Time) (*dedup.Lease, error) {
	mk := mapKey{key.Scope, key.ID}
	if e, ok := s.entries[mk]; ok && now.Before(e.expires) {
		switch {
		case !key.Fingerprint.Matches(e.fp):
			return nil, &dedup.ClaimError{Err: dedup.ErrFingerprintMismatch, Key: key}
		case e.done():
			// A copy: the caller may change what it is handed.
			return nil, &dedup.ClaimError{Err: dedup.ErrDuplicate, Key: key, Result: append([]byte(nil), e.result...)}
		default:
			return nil, &dedup.ClaimError{Err: dedup.ErrInFlight, Key: key, RetryAfter: max(e.expires.Sub(now), 0)}
		}
	}
	s.seq++
	token := s.tokenPrefix + strconv.FormatUint(s.seq, 16)
	s.entries[mk] = &entry{token: token, expires: now.Add(s.opts.Lease), fp: key.Fingerprint}
	return &dedup.Lease{Key: key, Token: token, TTL: s.opts.Lease}, nil
}

// ClaimBatch implements dedup.BatchLeaseStore.
func (s *Store) ClaimBatch(ctx context.Context, keys []dedup.Key) ([]dedup.BatchResult, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	out := make([]dedup.BatchResult, len(keys))
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, dedup.ErrClosed
	}
	now := s.opts.Clock.Now()
	for i, k := range keys {
		if err := dedup.ValidateKey(k, s.opts.MaxKeyLen); err != nil {
			out[i].Err = err
			continue
		}
		out[i].Lease, out[i].Err = s.claimLocked(k, now)
	}
	return out, nil
}

// owned runs f on the entry l owns, under s.mu, or returns ErrLeaseLost.
func (s *Store) owned(ctx context.Context, l *dedup.Lease, f func(mk mapKey, e *entry, now time.Time)) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if l == nil {
		return fmt.Errorf("memstore: nil lease: %w", dedup.ErrLeaseLost)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return dedup.ErrClosed
	}
	now := s.opts.Clock.Now()
	mk := mapKey{l.Key.Scope, l.Key.ID}
	e, ok := s.entries[mk]
	if !ok || e.done() || e.token != l.Token || !now.Before(e.expires) {
		return fmt.Errorf("memstore: key %s: %w", l.Key, dedup.ErrLeaseLost)
	}
	f(mk, e, now)
	return nil
}

// Extend implements dedup.LeaseStore.
func (s *Store) Extend(ctx context.Context, l *dedup.Lease) error {
	return s.owned(ctx, l, func(_ mapKey, e *entry, now time.Time) {
		e.expires = now.Add(s.opts.Lease)
	})
}

// Complete implements dedup.LeaseStore.
func (s *Store) Complete(ctx context.Context, l *dedup.Lease, result []byte) error {
	return s.owned(ctx, l, func(_ mapKey, e *entry, now time.Time) {
		e.token = ""
		e.expires = now.Add(s.opts.TTL)
		if len(result) > 0 {
			e.result = append([]byte(nil), result...)
		}
	})
}

// Release implements dedup.LeaseStore.
func (s *Store) Release(ctx context.Context, l *dedup.Lease) error {
	return s.owned(ctx, l, func(mk mapKey, _ *entry, _ time.Time) {
		delete(s.entries, mk)
	})
}

// wallClock is the default Clock: time.Now.
type wallClock struct{}

func (wallClock) Now() time.Time { return time.Now() }
