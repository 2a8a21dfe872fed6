package dedup

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"unicode/utf8"
)

// DefaultMaxKeyLen is the default limit, in bytes, on a key's scope and on its
// id.
const DefaultMaxKeyLen = 255

// Fingerprint is a SHA-256 digest of a message's content. The zero value means
// "no fingerprint": it matches any stored fingerprint.
type Fingerprint [sha256.Size]byte

// FingerprintOf returns the SHA-256 of the parts, each prefixed with its
// length so that ("ab","c") and ("a","bc") differ.
func FingerprintOf(parts ...[]byte) Fingerprint {
	h := sha256.New()
	var n [8]byte
	for _, p := range parts {
		l := uint64(len(p))
		for i := range n {
			n[i] = byte(l >> (8 * i))
		}
		h.Write(n[:])
		h.Write(p)
	}
	var f Fingerprint
	copy(f[:], h.Sum(nil))
	return f
}

// IsZero reports whether f is the zero (absent) fingerprint.
func (f Fingerprint) IsZero() bool { return f == Fingerprint{} }

// Matches reports whether f and stored are compatible: equal, or one of them
// absent.
func (f Fingerprint) Matches(stored Fingerprint) bool {
	return f.IsZero() || stored.IsZero() || f == stored
}

// Bytes returns the digest, or nil for the zero fingerprint.
func (f Fingerprint) Bytes() []byte {
	if f.IsZero() {
		return nil
	}
	b := make([]byte, len(f))
	copy(b, f[:])
	return b
}

// String returns the hex digest, or "" for the zero fingerprint.
func (f Fingerprint) String() string {
	if f.IsZero() {
		return ""
	}
	return hex.EncodeToString(f[:])
}

// FingerprintFromBytes converts stored bytes back into a Fingerprint. Empty
// input gives the zero fingerprint; any other length is an error.
func FingerprintFromBytes(b []byte) (Fingerprint, error) {
	var f Fingerprint
	if len(b) == 0 {
		return f, nil
	}
	if len(b) != len(f) {
		return f, fmt.Errorf("dedup: stored fingerprint has %d bytes, want %d", len(b), len(f))
	}
	copy(f[:], b)
	return f, nil
}

// Key identifies one message for one processor.
type Key struct {
	// Scope names who processes the message: consumer group and handler,
	// or principal, method and route.
	Scope string
	// ID is the producer-assigned id, stable across retries.
	ID string
	// Fingerprint is the digest of the content. Optional.
	Fingerprint Fingerprint
}

// NewKey returns a Key with the fingerprint of payload.
func NewKey(scope, id string, payload []byte) Key {
	return Key{Scope: scope, ID: id, Fingerprint: FingerprintOf(payload)}
}

// String returns "scope/id" for logs and errors. It does not include the
// fingerprint.
func (k Key) String() string { return k.Scope + "/" + k.ID }

// Validate checks the key against DefaultMaxKeyLen. See ValidateKey.
func (k Key) Validate() error { return ValidateKey(k, DefaultMaxKeyLen) }

// ValidateKey checks that scope and id are non-empty, at most maxLen bytes,
// valid UTF-8 and free of control bytes. The error wraps ErrInvalidKey and
// names the offending part. A maxLen of zero or less means DefaultMaxKeyLen.
func ValidateKey(k Key, maxLen int) error {
	if maxLen <= 0 {
		maxLen = DefaultMaxKeyLen
	}
	if err := validatePart("scope", k.Scope, maxLen); err != nil {
		return err
	}
	return validatePart("id", k.ID, maxLen)
}

func validatePart(name, s string, maxLen int) error {
	switch {
	case s == "":
		return fmt.Errorf("%w: %s is empty", ErrInvalidKey, name)
	case len(s) > maxLen:
		return fmt.Errorf("%w: %s is %d bytes, the limit is %d", ErrInvalidKey, name, len(s), maxLen)
	case !utf8.ValidString(s):
		return fmt.Errorf("%w: %s is not valid UTF-8", ErrInvalidKey, name)
	}
	for i, r := range s {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return fmt.Errorf("%w: %s has control byte %#x at offset %d", ErrInvalidKey, name, r, i)
		}
	}
	return nil
}
