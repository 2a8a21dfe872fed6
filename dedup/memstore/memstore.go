// Package memstore is an in-memory dedup.LeaseStore for examples, tests and
// the embedded demo. It has the same semantics as dedup/redisnx, including
// ErrLeaseLost for a stale owner, and takes an injectable clock so lease and
// retention expiry can be tested without sleeping.
//
// Marks live in the process: a restart forgets them. Use dedup/pgtable for
// anything that must survive one.
package memstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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
	// Clock tells the time. Defaults to dedup.SystemClock.
	Clock dedup.Clock
	// SweepInterval is how often expired entries are removed in the
	// background. Defaults to one minute; negative disables the sweeper
	// (expired entries are then removed only when their key is touched).
	SweepInterval time.Duration
}

const shardCount = 64

// mapKey is a key without its fingerprint: the map is keyed by (scope, id).
type mapKey struct{ scope, id string }

type shard struct {
	mu      sync.Mutex
	entries map[mapKey]entry // by value: one allocation less per claim
}

func (s *Store) shardOf(scope, id string) *shard {
	// FNV-1a over scope, a separator, and id.
	h := uint32(2166136261)
	for i := 0; i < len(scope); i++ {
		h = (h ^ uint32(scope[i])) * 16777619
	}
	h = (h ^ 0xff) * 16777619
	for i := 0; i < len(id); i++ {
		h = (h ^ uint32(id[i])) * 16777619
	}
	return &s.shards[h%shardCount]
}

type state uint8

const (
	inFlight state = iota + 1
	done
)

// entry is kept by value in its shard's map, and small: a map that holds
// every completed key for its TTL grows by copying its slots, and the
// collector scans them. The owner's token is its sequence number (the
// Lease's Token is the store's prefix and that number), times are offsets
// from the store's creation (monotonic with the system clock), and a result
// is a string only a result-bearing key (an HTTP response) pays for.
type entry struct {
	state   state
	seq     uint64 // the owner's token number while in flight
	expires int64  // lease expiry while in flight, retention end when done (Store.at)
	fp      dedup.Fingerprint
	result  string
}

// Store is an in-memory LeaseStore. It is safe for concurrent use. Close stops
// its sweeper.
//
// Keys are spread over shards, each with its own lock, so concurrent
// handlers rarely wait for each other.
type Store struct {
	opts Options

	closeMu sync.Mutex
	closed  atomic.Bool
	shards  [shardCount]shard

	stop chan struct{}
	wg   sync.WaitGroup

	tokenPrefix string
	tokenSeq    atomic.Uint64
	// base is the time entry offsets count from.
	base time.Time
}

// at is t as an entry time: its offset from s.base.
func (s *Store) at(t time.Time) int64 { return int64(t.Sub(s.base)) }

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
		opts.Clock = dedup.SystemClock{}
	}
	if opts.SweepInterval == 0 {
		opts.SweepInterval = time.Minute
	}
	var p [8]byte
	_, _ = rand.Read(p[:])
	s := &Store{opts: opts, stop: make(chan struct{}), tokenPrefix: hex.EncodeToString(p[:]) + "-", base: opts.Clock.Now()}
	for i := range s.shards {
		s.shards[i].entries = make(map[mapKey]entry)
	}
	if opts.SweepInterval > 0 {
		s.wg.Add(1)
		go s.sweep()
	}
	return s, nil
}

// Close stops the sweeper and makes every later call return dedup.ErrClosed.
// It is safe to call more than once.
func (s *Store) Close() error {
	s.closeMu.Lock()
	if s.closed.Load() {
		s.closeMu.Unlock()
		return nil
	}
	s.closed.Store(true)
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		sh.entries = nil
		sh.mu.Unlock()
	}
	s.closeMu.Unlock()
	close(s.stop)
	s.wg.Wait()
	return nil
}

// Len returns the number of entries held in memory, including expired ones
// the sweeper has not removed yet.
func (s *Store) Len() int {
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		n += len(sh.entries)
		sh.mu.Unlock()
	}
	return n
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
			now := s.at(s.opts.Clock.Now())
			for i := range s.shards {
				sh := &s.shards[i]
				sh.mu.Lock()
				for k, e := range sh.entries {
					if now >= e.expires {
						delete(sh.entries, k)
					}
				}
				sh.mu.Unlock()
			}
		}
	}
}

// newToken returns a token unique within the store: a random prefix chosen
// at New and a counter. Tokens only need to tell owners apart, and a
// counter is much cheaper per message than reading crypto/rand.
func (s *Store) newToken() (string, uint64) {
	seq := s.tokenSeq.Add(1)
	var buf [48]byte
	b := append(buf[:0], s.tokenPrefix...)
	return string(strconv.AppendUint(b, seq, 36)), seq
}

// tokenSeq is the sequence number of a token of this store, or 0.
func (s *Store) seqOf(token string) uint64 {
	rest, ok := strings.CutPrefix(token, s.tokenPrefix)
	if !ok {
		return 0
	}
	seq, err := strconv.ParseUint(rest, 36, 64)
	if err != nil {
		return 0
	}
	return seq
}

// Claim implements dedup.LeaseStore.
func (s *Store) Claim(ctx context.Context, key dedup.Key) (*dedup.Lease, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := dedup.ValidateKey(key, s.opts.MaxKeyLen); err != nil {
		return nil, err
	}
	sh := s.shardOf(key.Scope, key.ID)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if s.closed.Load() {
		return nil, dedup.ErrClosed
	}
	return s.claimLocked(sh, key)
}

// claimLocked claims key in sh, whose lock the caller holds.
func (s *Store) claimLocked(sh *shard, key dedup.Key) (*dedup.Lease, error) {
	now := s.opts.Clock.Now()
	id := mapKey{key.Scope, key.ID}
	t := s.at(now)
	if e, ok := sh.entries[id]; ok && t < e.expires {
		if !key.Fingerprint.Matches(e.fp) {
			return nil, dedup.Mismatch(key)
		}
		if e.state == done {
			return nil, dedup.Duplicate(key, resultBytes(e))
		}
		return nil, dedup.InFlight(key, time.Duration(e.expires-t))
	}
	token, seq := s.newToken()
	l := &dedup.Lease{Key: key, Token: token, TTL: s.opts.Lease}
	sh.entries[id] = entry{state: inFlight, seq: seq, fp: key.Fingerprint, expires: t + int64(s.opts.Lease)}
	return l, nil
}

// ClaimBatch implements dedup.BatchLeaseStore.
func (s *Store) ClaimBatch(ctx context.Context, keys []dedup.Key) ([]dedup.BatchResult, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if s.closed.Load() {
		return nil, dedup.ErrClosed
	}
	out := make([]dedup.BatchResult, len(keys))
	for i, k := range keys {
		if err := dedup.ValidateKey(k, s.opts.MaxKeyLen); err != nil {
			out[i].Err = err
			continue
		}
		sh := s.shardOf(k.Scope, k.ID)
		sh.mu.Lock()
		if s.closed.Load() {
			sh.mu.Unlock()
			return nil, dedup.ErrClosed
		}
		out[i].Lease, out[i].Err = s.claimLocked(sh, k)
		sh.mu.Unlock()
	}
	return out, nil
}

// owned locks the shard of l's key and returns it with the entry l owns and
// the time. On success the caller must unlock the shard, and store the entry
// back if it changed it.
func (s *Store) owned(l *dedup.Lease) (*shard, entry, int64, error) {
	if l == nil {
		return nil, entry{}, 0, fmt.Errorf("memstore: nil lease: %w", dedup.ErrLeaseLost)
	}
	seq := s.seqOf(l.Token)
	sh := s.shardOf(l.Key.Scope, l.Key.ID)
	sh.mu.Lock()
	if s.closed.Load() {
		sh.mu.Unlock()
		return nil, entry{}, 0, dedup.ErrClosed
	}
	now := s.at(s.opts.Clock.Now())
	e, ok := sh.entries[mapKey{l.Key.Scope, l.Key.ID}]
	if !ok || e.state != inFlight || seq == 0 || e.seq != seq || now >= e.expires {
		sh.mu.Unlock()
		return nil, entry{}, 0, fmt.Errorf("memstore: key %s: %w", l.Key, dedup.ErrLeaseLost)
	}
	return sh, e, now, nil
}

// Extend implements dedup.LeaseStore.
func (s *Store) Extend(ctx context.Context, l *dedup.Lease) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	sh, e, now, err := s.owned(l)
	if err != nil {
		return err
	}
	defer sh.mu.Unlock()
	e.expires = now + int64(s.opts.Lease)
	sh.entries[mapKey{l.Key.Scope, l.Key.ID}] = e
	return nil
}

// Complete implements dedup.LeaseStore.
func (s *Store) Complete(ctx context.Context, l *dedup.Lease, result []byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	sh, e, now, err := s.owned(l)
	if err != nil {
		return err
	}
	defer sh.mu.Unlock()
	e.state = done
	e.seq = 0
	e.result = string(result)
	e.expires = now + int64(s.opts.TTL)
	sh.entries[mapKey{l.Key.Scope, l.Key.ID}] = e
	return nil
}

// Release implements dedup.LeaseStore.
func (s *Store) Release(ctx context.Context, l *dedup.Lease) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	sh, _, _, err := s.owned(l)
	if err != nil {
		return err
	}
	defer sh.mu.Unlock()
	delete(sh.entries, mapKey{l.Key.Scope, l.Key.ID})
	return nil
}

// resultBytes is the stored result of a done entry: nil when Complete got
// nil or an empty result.
func resultBytes(e entry) []byte {
	if e.result == "" {
		return nil
	}
	return []byte(e.result)
}
