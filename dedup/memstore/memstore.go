// Package memstore is an in-memory dedup.LeaseStore for examples, tests and
// the embedded demo. It has the same semantics as dedup/redisnx, including
// ErrLeaseLost for a stale owner, and takes an injectable clock so lease and
// retention expiry can be tested without sleeping.
//
// Marks live in the process: a restart forgets them. Use dedup/pgtable for
// anything that must survive one.
//
// The store is a map behind one mutex, and a sweeper goroutine that removes
// expired keys every Options.SweepInterval; Close stops it. The map holds a
// 128-bit digest of scope and id, not the key itself, with the key's state,
// expiry and fingerprint: 64 bytes, which with the map's free slots makes
// 75 to 150 bytes of heap per key, and no pointer for the garbage collector
// to follow. A result passed to Complete is kept besides.
package memstore

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
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

// digest names a key in the map: the first 16 bytes of the SHA-256 of
// scope, a zero byte and id. Keys are validated to hold no control bytes, so
// the zero byte separates scope from id and two different keys hash two
// different inputs. A collision would make one key a duplicate of another:
// with 128 bits of SHA-256 its chance among a billion keys is below 10^-20,
// and choosing the ids does not help find one.
type digest [16]byte

func digestOf(k dedup.Key) digest {
	h := sha256.New()
	h.Write([]byte(k.Scope))
	h.Write([]byte{0})
	h.Write([]byte(k.ID))
	var sum [sha256.Size]byte
	return digest(h.Sum(sum[:0]))
}

// mark is a key's state: in flight under the lease numbered token until
// expires, or done (token 0) and remembered until expires. expires counts
// nanoseconds from the store's epoch. A mark holds no pointer, so the
// garbage collector never scans the map's memory. A done key's result, when
// it has one, is kept in Store.results.
type mark struct {
	expires int64
	token   uint64
	fp      dedup.Fingerprint
}

func (m *mark) done() bool { return m.token == 0 }

// Store is an in-memory LeaseStore. It is safe for concurrent use. Close stops
// its sweeper.
type Store struct {
	opts Options
	// epoch is the time marks count their expiry from: a time.Time from
	// the clock, so that with the wall clock the expiry is measured on
	// the monotonic clock (time.Time.Sub) and a step of the wall clock
	// neither expires leases nor revives marks.
	epoch time.Time

	mu      sync.Mutex
	marks   map[digest]mark
	results map[digest]string // the results of done keys, when not empty
	closed  bool
	seq     uint64 // the number of the last lease granted

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
	s := &Store{opts: opts, epoch: opts.Clock.Now(),
		marks: make(map[digest]mark), results: make(map[digest]string),
		stop: make(chan struct{}), tokenPrefix: hex.EncodeToString(p[:]) + "-"}
	if opts.SweepInterval > 0 {
		s.wg.Add(1)
		go s.sweep()
	}
	return s, nil
}

// now reads the clock, in nanoseconds since the store's epoch.
func (s *Store) now() int64 { return int64(s.opts.Clock.Now().Sub(s.epoch)) }

// Close stops the sweeper, forgets every mark and makes every later call
// return dedup.ErrClosed. It is safe to call more than once.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.marks, s.results = nil, nil
	s.mu.Unlock()
	close(s.stop)
	s.wg.Wait()
	return nil
}

// Len returns the number of keys held in memory, including expired ones
// the sweeper has not removed yet.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.marks)
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
			s.sweepOnce()
		}
	}
}

// sweepOnce removes the expired keys.
func (s *Store) sweepOnce() {
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	for d, m := range s.marks {
		if m.expires <= now {
			s.removeLocked(d)
		}
	}
}

// removeLocked forgets the key d names, and its result; the caller holds
// s.mu.
func (s *Store) removeLocked(d digest) {
	delete(s.marks, d)
	if len(s.results) > 0 {
		delete(s.results, d)
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
	d := digestOf(key)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, dedup.ErrClosed
	}
	return s.claimLocked(key, d, s.now())
}

// claimLocked claims key, whose digest is d, at now; the caller holds s.mu.
func (s *Store) claimLocked(key dedup.Key, d digest, now int64) (*dedup.Lease, error) {
	if m, ok := s.marks[d]; ok {
		switch {
		case m.expires <= now:
			// Expired: the key is absent.
			if m.done() {
				s.removeLocked(d)
			}
		case !key.Fingerprint.Matches(m.fp):
			return nil, &dedup.ClaimError{Err: dedup.ErrFingerprintMismatch, Key: key}
		case m.done():
			var result []byte
			if r, ok := s.results[d]; ok {
				// A copy: the caller may change what it is handed.
				result = []byte(r)
			}
			return nil, &dedup.ClaimError{Err: dedup.ErrDuplicate, Key: key, Result: result}
		default:
			return nil, &dedup.ClaimError{Err: dedup.ErrInFlight, Key: key, RetryAfter: time.Duration(m.expires - now)}
		}
	}
	s.seq++
	s.marks[d] = mark{expires: now + int64(s.opts.Lease), token: s.seq, fp: key.Fingerprint}
	return &dedup.Lease{Key: key, Token: s.token(s.seq), TTL: s.opts.Lease}, nil
}

// ClaimBatch implements dedup.BatchLeaseStore.
func (s *Store) ClaimBatch(ctx context.Context, keys []dedup.Key) ([]dedup.BatchResult, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	out := make([]dedup.BatchResult, len(keys))
	ds := make([]digest, len(keys))
	for i, k := range keys {
		if out[i].Err = dedup.ValidateKey(k, s.opts.MaxKeyLen); out[i].Err == nil {
			ds[i] = digestOf(k)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, dedup.ErrClosed
	}
	now := s.now()
	for i, k := range keys {
		if out[i].Err == nil {
			out[i].Lease, out[i].Err = s.claimLocked(k, ds[i], now)
		}
	}
	return out, nil
}

// token returns the token of lease number seq: the store's prefix and seq
// in lowercase hex.
func (s *Store) token(seq uint64) string {
	var buf [40]byte
	return string(strconv.AppendUint(append(buf[:0], s.tokenPrefix...), seq, 16))
}

// tokenSeq returns the lease number of a token this store handed out, or 0
// (no lease) for any other string. Only the exact string the store handed
// out parses: lowercase hex without leading zeros.
func (s *Store) tokenSeq(token string) uint64 {
	h, ok := strings.CutPrefix(token, s.tokenPrefix)
	if !ok || h == "" || len(h) > 16 || h[0] == '0' {
		return 0
	}
	var seq uint64
	for i := range len(h) {
		switch c := h[i]; {
		case '0' <= c && c <= '9':
			seq = seq<<4 | uint64(c-'0')
		case 'a' <= c && c <= 'f':
			seq = seq<<4 | uint64(c-'a'+10)
		default:
			return 0
		}
	}
	return seq
}

// Lease operations on an owned key.
type leaseOp int

const (
	opExtend leaseOp = iota
	opComplete
	opRelease
)

// settle applies op to the key l owns, or returns ErrLeaseLost.
func (s *Store) settle(ctx context.Context, l *dedup.Lease, op leaseOp, result []byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if l == nil {
		return fmt.Errorf("memstore: nil lease: %w", dedup.ErrLeaseLost)
	}
	seq := s.tokenSeq(l.Token)
	d := digestOf(l.Key)
	var stored string
	if op == opComplete {
		stored = string(result)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return dedup.ErrClosed
	}
	now := s.now()
	m, ok := s.marks[d]
	if !ok || m.done() || m.token != seq || m.expires <= now {
		return fmt.Errorf("memstore: key %s: %w", l.Key, dedup.ErrLeaseLost)
	}
	switch op {
	case opExtend:
		m.expires = now + int64(s.opts.Lease)
		s.marks[d] = m
	case opComplete:
		m.token, m.expires = 0, now+int64(s.opts.TTL)
		s.marks[d] = m
		if stored != "" {
			s.results[d] = stored
		}
	case opRelease:
		delete(s.marks, d)
	}
	return nil
}

// Extend implements dedup.LeaseStore.
func (s *Store) Extend(ctx context.Context, l *dedup.Lease) error {
	return s.settle(ctx, l, opExtend, nil)
}

// Complete implements dedup.LeaseStore.
func (s *Store) Complete(ctx context.Context, l *dedup.Lease, result []byte) error {
	return s.settle(ctx, l, opComplete, result)
}

// Release implements dedup.LeaseStore.
func (s *Store) Release(ctx context.Context, l *dedup.Lease) error {
	return s.settle(ctx, l, opRelease, nil)
}

// wallClock is the default Clock: time.Now.
type wallClock struct{}

func (wallClock) Now() time.Time { return time.Now() }
