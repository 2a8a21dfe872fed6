// Package memstore is an in-memory dedup.LeaseStore for examples, tests and
// the embedded demo. It has the same semantics as dedup/redisnx, including
// ErrLeaseLost for a stale owner, and takes an injectable clock so lease and
// retention expiry can be tested without sleeping.
//
// Marks live in the process: a restart forgets them. Use dedup/pgtable for
// anything that must survive one.
//
// # Keys are stored as 128-bit hashes
//
// The store does not keep a key's scope and id. It keeps a 128-bit hash of
// them: two 64-bit hash/maphash values of the length-prefixed scope followed
// by the id, under two independent random seeds chosen at New. Each shard is
// an open-addressing table of fixed-size slots without pointers (hash, state,
// owner's token number, expiry, fingerprint), which a claim reads and writes
// in one probe and the garbage collector does not scan. The result of a
// result-bearing Complete is kept in a separate map, only when non-empty.
//
// Two different keys with the same 128-bit hash would share one mark: the
// second would be reported as a duplicate (or in flight, or a fingerprint
// mismatch) of the first and its message dropped. Treating maphash under a
// random seed as a random function, the chance that any two of n keys
// claimed by one Store collide is at most n²/2¹²⁹ (the birthday bound):
// about 1.5·10⁻²⁷ for a million keys, 1.5·10⁻²¹ for 10⁹ keys. maphash is not
// a cryptographic hash and promises no collision resistance; the bound is
// for keys not chosen to attack it. Its seeds are secret (they never leave
// the process), which is what keeps keys from being chosen to collide.
//
// The token numbers of a Store's leases must stay below 2⁶¹, that is fewer
// than 2⁶¹ claims in its lifetime (a little fewer: each shard takes its
// numbers 32 at a time).
package memstore

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"hash/maphash"
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

// shardCount is a power of two: the top bits of a key's hash pick its shard.
const shardCount = 64

// shardShift leaves the top log2(shardCount) bits of h1.
const shardShift = 64 - 6

// hkey is a key's 128-bit hash, without its fingerprint.
type hkey [2]uint64

type shard struct {
	mu sync.Mutex
	t  table
	// results holds the non-empty results of done keys (slot metaResult).
	// Allocated on first use.
	results map[hkey]string
	// leases and tokens are what is left of the shard's current block of
	// leaseBlock leases and their tokens (see Store.lease); nextSeq is the
	// token number of tokens' first token.
	leases  []dedup.Lease
	tokens  string
	nextSeq uint64
}

// hash is the 128-bit hash of (scope, id), and the shard that holds it.
func (s *Store) hash(scope, id string) (*shard, hkey) {
	var h hkey
	var buf [128]byte
	if n := 8 + len(scope) + len(id); n <= len(buf) {
		binary.LittleEndian.PutUint64(buf[:8], uint64(len(scope)))
		copy(buf[8:], scope)
		copy(buf[8+len(scope):], id)
		// maphash.Bytes(seed, b) is, by its documentation, the Hash of
		// b under seed, so short and long keys hash alike.
		h = hkey{maphash.Bytes(s.seeds[0], buf[:n]), maphash.Bytes(s.seeds[1], buf[:n])}
	} else {
		h = hkey{hashLong(s.seeds[0], scope, id), hashLong(s.seeds[1], scope, id)}
	}
	return &s.shards[h[1]>>shardShift], h
}

// hashLong hashes the same bytes as Store.hash, without a buffer.
func hashLong(seed maphash.Seed, scope, id string) uint64 {
	var h maphash.Hash
	h.SetSeed(seed)
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(scope)))
	_, _ = h.Write(n[:])
	_, _ = h.WriteString(scope)
	_, _ = h.WriteString(id)
	return h.Sum64()
}

type state uint8

const (
	inFlight state = iota + 1
	done
)

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
	seeds   [2]maphash.Seed

	stop chan struct{}
	wg   sync.WaitGroup

	tokenPrefix string
	tokenSeq    atomic.Uint64
	// base is the time entry offsets count from.
	base time.Time
	// system: the clock is dedup.SystemClock, so the time since base is
	// read from the monotonic clock alone (time.Since), which costs about
	// half of time.Now on every claim and completion.
	system bool
}

// at is t as a slot time: its offset from s.base.
func (s *Store) at(t time.Time) int64 { return int64(t.Sub(s.base)) }

// now is the current slot time. With the system clock, time.Since(s.base)
// is what s.at(time.Now()) computes: both subtract s.base's monotonic
// reading from the current one.
func (s *Store) now() int64 {
	if s.system {
		return int64(time.Since(s.base))
	}
	return s.at(s.opts.Clock.Now())
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
		opts.Clock = dedup.SystemClock{}
	}
	if opts.SweepInterval == 0 {
		opts.SweepInterval = time.Minute
	}
	var p [8]byte
	_, _ = rand.Read(p[:])
	s := &Store{opts: opts, stop: make(chan struct{}), tokenPrefix: hex.EncodeToString(p[:]) + "-", base: opts.Clock.Now()}
	_, s.system = opts.Clock.(dedup.SystemClock)
	s.seeds = [2]maphash.Seed{maphash.MakeSeed(), maphash.MakeSeed()}
	for i := range s.shards {
		s.shards[i].t.homeMask = ^uint64(0)
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
		sh.t = table{homeMask: sh.t.homeMask}
		sh.results = nil
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
		n += sh.t.n
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
			now := s.now()
			for i := range s.shards {
				sh := &s.shards[i]
				sh.mu.Lock()
				sh.removeExpired(now)
				sh.mu.Unlock()
			}
		}
	}
}

// removeExpired removes the slots whose expiry is at or before now, and
// shrinks the table if that leaves it mostly empty. The caller holds sh.mu.
func (sh *shard) removeExpired(now int64) {
	t := &sh.t
	for i := 0; i < len(t.slots); {
		sl := &t.slots[i]
		if sl.empty() || now < sl.expires {
			i++
			continue
		}
		if sl.hasResult() {
			delete(sh.results, hkey{sl.h0, sl.h1})
		}
		// remove shifts a later slot of the chain into i, if any: look
		// at i again. A slot shifted from the start of the table past
		// its end was already kept, and is only looked at twice.
		t.remove(i)
	}
	t.shrink()
}

// leaseBlock is the number of leases, and of their tokens, a shard
// allocates at a time.
const leaseBlock = 32

// tokenDigits is the width of a token's number: 16 hex digits, so that
// every token of a store has the same length and a block of tokens is one
// string cut in equal parts.
const tokenDigits = 16

// lease returns a new lease of key, with a token unique within the store: a
// random prefix chosen at New and a token number, which the key's slot
// keeps. The caller holds sh.mu.
//
// A claim is the store's only per-message allocation site, and it used to
// make two allocations, the Lease and its token's string. Both now come
// from blocks: leaseBlock leases in one slice, and their tokens in one
// string, so a claim allocates nothing most of the time. A block stays
// reachable while any of its leases (or tokens) is: at most leaseBlock-1
// used leases and their keys' strings are kept alive a little longer.
func (s *Store) lease(sh *shard, key dedup.Key) (*dedup.Lease, uint64) {
	if len(sh.leases) == 0 {
		sh.newBlock(s)
	}
	l := &sh.leases[0]
	sh.leases = sh.leases[1:]
	w := len(s.tokenPrefix) + tokenDigits
	*l = dedup.Lease{Key: key, Token: sh.tokens[:w], TTL: s.opts.Lease}
	sh.tokens = sh.tokens[w:]
	seq := sh.nextSeq
	sh.nextSeq++
	return l, seq
}

// newBlock allocates the shard's next block of leases and tokens, taking
// leaseBlock token numbers from the store's sequence. The caller holds
// sh.mu.
func (sh *shard) newBlock(s *Store) {
	first := s.tokenSeq.Add(leaseBlock) - leaseBlock + 1
	w := len(s.tokenPrefix) + tokenDigits
	b := make([]byte, 0, leaseBlock*w)
	for seq := first; seq < first+leaseBlock; seq++ {
		b = append(b, s.tokenPrefix...)
		b = appendHex(b, seq)
	}
	sh.leases = make([]dedup.Lease, leaseBlock)
	sh.tokens = string(b)
	sh.nextSeq = first
}

// appendHex appends seq as tokenDigits lower-case hex digits.
func appendHex(b []byte, seq uint64) []byte {
	const digits = "0123456789abcdef"
	for shift := 4 * (tokenDigits - 1); shift >= 0; shift -= 4 {
		b = append(b, digits[seq>>uint(shift)&0xf])
	}
	return b
}

// seqOf is the token number of a token of this store, or 0.
func (s *Store) seqOf(token string) uint64 {
	rest, ok := strings.CutPrefix(token, s.tokenPrefix)
	if !ok || len(rest) != tokenDigits {
		return 0
	}
	// Exactly the digits appendHex writes: ParseUint would also take
	// upper-case ones, and a token that is not the one handed out must
	// not own the key.
	var seq uint64
	for i := 0; i < len(rest); i++ {
		c := rest[i]
		switch {
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

// Claim implements dedup.LeaseStore.
func (s *Store) Claim(ctx context.Context, key dedup.Key) (*dedup.Lease, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := dedup.ValidateKey(key, s.opts.MaxKeyLen); err != nil {
		return nil, err
	}
	sh, h := s.hash(key.Scope, key.ID)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if s.closed.Load() {
		return nil, dedup.ErrClosed
	}
	return s.claimLocked(sh, h, key)
}

// claimLocked claims key, whose hash is h, in sh, whose lock the caller
// holds. One probe finds the key's slot or the empty slot it takes.
func (s *Store) claimLocked(sh *shard, h hkey, key dedup.Key) (*dedup.Lease, error) {
	t := s.now()
	i, ok := sh.t.find(h[0], h[1])
	if ok {
		e := &sh.t.slots[i]
		if t < e.expires {
			return nil, sh.held(e, h, key, t)
		}
		// Expired: the key is claimed afresh in its old slot.
		if e.hasResult() {
			delete(sh.results, h)
		}
	} else if i < 0 || (sh.t.n+1)*4 > len(sh.t.slots)*3 {
		sh.t.reserve()
		i, _ = sh.t.find(h[0], h[1])
	}
	if !ok {
		sh.t.n++
	}
	l, seq := s.lease(sh, key)
	sh.t.slots[i] = slot{h0: h[0], h1: h[1], meta: inFlightMeta(seq), fp: key.Fingerprint, expires: t + int64(s.opts.Lease)}
	return l, nil
}

// held is the error for a claim of key, whose live slot is e: a fingerprint
// mismatch, a duplicate, or in flight. It is apart from claimLocked, which
// it would otherwise make use a frame twice as large for the common case,
// a first claim.
func (sh *shard) held(e *slot, h hkey, key dedup.Key, t int64) error {
	if !key.Fingerprint.Matches(e.fp) {
		return dedup.Mismatch(key)
	}
	if e.state() == done {
		return dedup.Duplicate(key, sh.result(e, h))
	}
	return dedup.InFlight(key, time.Duration(e.expires-t))
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
		sh, h := s.hash(k.Scope, k.ID)
		sh.mu.Lock()
		if s.closed.Load() {
			sh.mu.Unlock()
			return nil, dedup.ErrClosed
		}
		out[i].Lease, out[i].Err = s.claimLocked(sh, h, k)
		sh.mu.Unlock()
	}
	return out, nil
}

// owned locks the shard of l's key and returns it with the index of the slot
// l owns, the key's hash and the time. On success the caller must unlock the
// shard.
func (s *Store) owned(l *dedup.Lease) (*shard, int, hkey, int64, error) {
	if l == nil {
		return nil, 0, hkey{}, 0, fmt.Errorf("memstore: nil lease: %w", dedup.ErrLeaseLost)
	}
	seq := s.seqOf(l.Token)
	sh, h := s.hash(l.Key.Scope, l.Key.ID)
	sh.mu.Lock()
	if s.closed.Load() {
		sh.mu.Unlock()
		return nil, 0, hkey{}, 0, dedup.ErrClosed
	}
	now := s.now()
	i, ok := sh.t.find(h[0], h[1])
	if !ok {
		sh.mu.Unlock()
		return nil, 0, hkey{}, 0, fmt.Errorf("memstore: key %s: %w", l.Key, dedup.ErrLeaseLost)
	}
	if e := &sh.t.slots[i]; e.state() != inFlight || seq == 0 || e.seq() != seq || now >= e.expires {
		sh.mu.Unlock()
		return nil, 0, hkey{}, 0, fmt.Errorf("memstore: key %s: %w", l.Key, dedup.ErrLeaseLost)
	}
	return sh, i, h, now, nil
}

// Extend implements dedup.LeaseStore.
func (s *Store) Extend(ctx context.Context, l *dedup.Lease) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	sh, i, _, now, err := s.owned(l)
	if err != nil {
		return err
	}
	defer sh.mu.Unlock()
	sh.t.slots[i].expires = now + int64(s.opts.Lease)
	return nil
}

// Complete implements dedup.LeaseStore.
func (s *Store) Complete(ctx context.Context, l *dedup.Lease, result []byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	sh, i, h, now, err := s.owned(l)
	if err != nil {
		return err
	}
	defer sh.mu.Unlock()
	e := &sh.t.slots[i]
	e.meta = uint64(done)
	e.expires = now + int64(s.opts.TTL)
	if len(result) > 0 {
		if sh.results == nil {
			sh.results = make(map[hkey]string)
		}
		sh.results[h] = string(result)
		e.meta |= metaResult
	}
	return nil
}

// Release implements dedup.LeaseStore.
func (s *Store) Release(ctx context.Context, l *dedup.Lease) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	sh, i, _, _, err := s.owned(l)
	if err != nil {
		return err
	}
	defer sh.mu.Unlock()
	// An in-flight slot has no result.
	sh.t.remove(i)
	return nil
}

// result is the stored result of a done slot: nil when Complete got nil or
// an empty result.
func (sh *shard) result(e *slot, h hkey) []byte {
	if !e.hasResult() {
		return nil
	}
	return []byte(sh.results[h])
}
