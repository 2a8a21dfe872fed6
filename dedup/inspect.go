package dedup

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"time"
)

// Digest is what the stores keep of a key's scope and id: the first 16
// bytes of SHA-256(scope || 0x00 || id). dedup/pgtable and dedup/sqltable
// find a key's row by it (their key and digest columns), dedup/redisnx
// builds the key's Redis key from it, and Key.Hash, the form logs show, is
// its first 8 bytes in hex.
type Digest [16]byte

// DigestOf returns the digest of scope and id.
func DigestOf(scope, id string) Digest {
	h := sha256.New()
	h.Write([]byte(scope))
	h.Write([]byte{0})
	h.Write([]byte(id))
	var sum [sha256.Size]byte
	return Digest(h.Sum(sum[:0])[:16])
}

// Digest returns the digest of k's scope and id.
func (k Key) Digest() Digest { return DigestOf(k.Scope, k.ID) }

// String returns the digest in hex, 32 digits.
func (d Digest) String() string { return hex.EncodeToString(d[:]) }

// Hash returns the first 8 bytes in hex: the Key.Hash of the key whose
// digest d is.
func (d Digest) Hash() string { return hex.EncodeToString(d[:8]) }

// ParseDigest reads a digest written as 32 hex digits, with or without the
// dashes of a UUID (pgtable's key column is a uuid). A Key.Hash, 16 digits,
// is only the first half of a digest and is refused.
func ParseDigest(s string) (Digest, error) {
	var d Digest
	h := strings.ReplaceAll(strings.TrimSpace(s), "-", "")
	if len(h) == 16 {
		return d, fmt.Errorf("dedup: digest %q has 16 hex digits: that is a key's Hash, as logs show it (8 bytes); the stored digest has 32", s)
	}
	if len(h) != 32 {
		return d, fmt.Errorf("dedup: digest %q: want 32 hex digits (16 bytes), with or without the dashes of a UUID", s)
	}
	if _, err := hex.Decode(d[:], []byte(h)); err != nil {
		return d, fmt.Errorf("dedup: digest %q: %w", s, err)
	}
	return d, nil
}

// KeyStatus is what a store holds for a key.
type KeyStatus uint8

// The states of a key, as KeyState reports them.
const (
	// KeyAbsent: the store holds nothing for the key; a claim wins.
	KeyAbsent KeyStatus = iota
	// KeyInFlight: a lease holds the key (the lease mode of a store).
	KeyInFlight
	// KeyDone: the key was processed; a claim answers ErrDuplicate.
	KeyDone
)

// String returns "absent", "in flight" or "done".
func (s KeyStatus) String() string {
	switch s {
	case KeyAbsent:
		return "absent"
	case KeyInFlight:
		return "in flight"
	case KeyDone:
		return "done"
	}
	return fmt.Sprintf("KeyStatus(%d)", uint8(s))
}

// KeyState is what a store holds for one key, as an operator reads it (the
// Inspect methods of the stores, and "idem dedup show").
type KeyState struct {
	// Digest is the key's digest, by which the store found it.
	Digest Digest
	// Status is KeyInFlight or KeyDone when the store holds a row or
	// record for the key, else KeyAbsent and the other fields are zero.
	Status KeyStatus
	// Expired is true for a row whose time has passed: a lease that ran
	// out (Status KeyInFlight) or a done key past its retention (KeyDone)
	// that cleanup has not deleted yet. Such a row no longer holds its
	// key: a claim takes it over. A Redis record is deleted by Redis when
	// it expires, so it never reads as expired.
	Expired bool
	// ExpiresAt is when the lease ends (in flight) or the retention ends
	// (done), by the store's clock. Zero when the store did not say.
	ExpiresAt time.Time
	// Fingerprint is the stored fingerprint; zero when the key has none.
	Fingerprint Fingerprint
	// Result is the stored result of a done key; nil when none.
	Result []byte
	// Scope and ID are the key's, when the store keeps them
	// (KeysKept: the KeepKeys option of dedup/pgtable and dedup/sqltable).
	Scope, ID string
	KeysKept  bool
}

// Held reports whether the store holds the key: in flight or done, and
// not expired. A claim of a key not held wins.
func (s KeyState) Held() bool { return s.Status != KeyAbsent && !s.Expired }
