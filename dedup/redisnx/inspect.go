package redisnx

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
)

// Inspect reads what Redis holds for key, for an operator ("idem dedup
// show"): in flight or done, when the record expires (its remaining TTL
// added to the client's clock), its fingerprint and, once done, its result.
// A key with no record is dedup.KeyAbsent; Redis deletes a record when it
// expires, so a record never reads as expired. Redis keeps no scope or id
// (KeysKept is false). Unless Options.SkipPreviousLayout is set, the key of
// the previous layout is read too, in the same MULTI, and its record
// answers when there is one, as a claim would answer from it. It claims
// nothing; the key is not validated.
func (s *Store) Inspect(ctx context.Context, key dedup.Key) (dedup.KeyState, error) {
	sum := digest(key)
	keys := []string{s.redisKey(&sum)}
	if s.oldPrefix != "" {
		keys = append(keys, s.oldKeyOf(key, &sum))
	}
	return s.inspect(ctx, key.Digest(), keys)
}

// InspectDigest is Inspect by the key's digest, when scope and id are not
// known: it reads the key of the current layout only (the previous
// layout's key holds the scope and id).
func (s *Store) InspectDigest(ctx context.Context, d dedup.Digest) (dedup.KeyState, error) {
	var sum [sha256.Size]byte
	copy(sum[:], d[:])
	return s.inspect(ctx, d, []string{s.redisKey(&sum)})
}

// inspect reads keys, all in one slot, in one MULTI: GET and PTTL of each.
// The last key holding a record answers.
func (s *Store) inspect(ctx context.Context, d dedup.Digest, keys []string) (dedup.KeyState, error) {
	gets := make([]*redis.StringCmd, len(keys))
	ttls := make([]*redis.DurationCmd, len(keys))
	_, err := s.client.TxPipelined(ctx, func(p redis.Pipeliner) error {
		for i, k := range keys {
			gets[i] = p.Get(ctx, k)
			ttls[i] = p.PTTL(ctx, k)
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return dedup.KeyState{}, fmt.Errorf("redisnx: inspect #%s: %w", d.Hash(), err)
	}
	now := time.Now()
	st := dedup.KeyState{Digest: d}
	for i := len(keys) - 1; i >= 0; i-- {
		v, err := gets[i].Result()
		if errors.Is(err, redis.Nil) {
			continue
		}
		if err != nil {
			return dedup.KeyState{}, fmt.Errorf("redisnx: inspect #%s: GET %s: %w", d.Hash(), keys[i], err)
		}
		state, fp, rest, ok := parseRecord(v)
		if !ok {
			return dedup.KeyState{}, fmt.Errorf("redisnx: inspect #%s: %s holds %d bytes that are not an idem record", d.Hash(), keys[i], len(v))
		}
		st.Status, st.Fingerprint = dedup.KeyInFlight, fp
		if state == stateDone {
			st.Status = dedup.KeyDone
			if rest != "" {
				st.Result = []byte(rest)
			}
		}
		// PTTL is -1 for a key without an expiry (never set by idem) and
		// -2 for one gone since the GET (not possible inside MULTI).
		if ttl, err := ttls[i].Result(); err == nil && ttl >= 0 {
			st.ExpiresAt = now.Add(ttl)
		}
		return st, nil
	}
	return st, nil
}
