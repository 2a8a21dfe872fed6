package redisnx

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"strconv"
	"strings"

	"github.com/idemkit/idem/dedup"
)

// RedisKey returns the Redis key that holds k, for operators and tests. The
// fingerprint is not part of the key. See the package doc for the layout.
func (s *Store) RedisKey(k dedup.Key) string {
	sum := digest(k)
	return s.redisKey(&sum)
}

// redisKey is RedisKey of the key whose digest is sum.
func (s *Store) redisKey(sum *[sha256.Size]byte) string {
	var b [16 + 1 + 11]byte
	hex.Encode(b[:16], sum[:8])
	b[16] = '}'
	base64.RawURLEncoding.Encode(b[17:], sum[8:16])
	return s.prefix + string(b[:])
}

// oldKey returns the key of k in the previous layout, which Claim still
// reads (see the package doc). It shares RedisKey's hash tag, so both keys
// live in the same slot.
func (s *Store) oldKey(k dedup.Key) string {
	sum := digest(k)
	return s.oldKeyOf(k, &sum)
}

// oldKeyOf is oldKey of k, whose digest is sum.
func (s *Store) oldKeyOf(k dedup.Key, sum *[sha256.Size]byte) string {
	var tag [16]byte
	hex.Encode(tag[:], sum[:8])
	n := strconv.Itoa(len(k.Scope))
	var b strings.Builder
	b.Grow(len(s.oldPrefix) + len(tag) + 2 + len(n) + 1 + len(k.Scope) + 1 + len(k.ID))
	b.WriteString(s.oldPrefix)
	b.Write(tag[:])
	b.WriteString("}:")
	b.WriteString(n)
	b.WriteByte(':')
	b.WriteString(k.Scope)
	b.WriteByte(':')
	b.WriteString(k.ID)
	return b.String()
}

// digest is SHA-256(scope, 0x00, id).
func digest(k dedup.Key) [sha256.Size]byte {
	var stack [2*dedup.DefaultMaxKeyLen + 1]byte
	in := append(stack[:0], k.Scope...)
	in = append(in, 0)
	in = append(in, k.ID...)
	return sha256.Sum256(in)
}

func newToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand, Go 1.24+)
	return hex.EncodeToString(b[:])
}

// inFlightRecord is the value a claim sets: the fingerprint only when the
// key has one.
func inFlightRecord(fp dedup.Fingerprint, token string) []byte {
	if fp.IsZero() {
		return append([]byte{stateInFlightNF}, token...)
	}
	rec := make([]byte, 0, 1+fpLen+len(token))
	rec = append(rec, stateInFlight)
	rec = append(rec, fp[:]...)
	return append(rec, token...)
}

// parseRecord splits a stored record, of this layout or the previous one
// (which always has a fingerprint, all zeros when absent). state is
// stateInFlight or stateDone whether or not the record holds a fingerprint;
// ok is false when the value is not a record (idem does not share its
// prefix, but someone may write there).
func parseRecord(v string) (state byte, fp dedup.Fingerprint, rest string, ok bool) {
	if v == "" {
		return 0, fp, "", false
	}
	if v == doneBare {
		return stateDone, fp, "", true
	}
	switch v[0] {
	case stateInFlightNF:
		return stateInFlight, fp, v[1:], true
	case stateDoneNF:
		return stateDone, fp, v[1:], true
	case stateInFlight, stateDone:
		if len(v) < 1+fpLen {
			return 0, fp, "", false
		}
		copy(fp[:], v[1:1+fpLen])
		return v[0], fp, v[1+fpLen:], true
	}
	return 0, fp, "", false
}
