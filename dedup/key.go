package dedup

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"hash"
	"log/slog"
	"sync"
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
	// A pooled digest with its buffers: no allocation per call, and a
	// small stack frame, which matters to a handler that runs on a new
	// goroutine (Watermill's router starts one per message, and a large
	// frame would make it copy its stack every time).
	d := digests.Get().(*digest)
	d.h.Reset()
	for _, p := range parts {
		binary.LittleEndian.PutUint64(d.n[:], uint64(len(p)))
		d.h.Write(d.n[:])
		d.h.Write(p)
	}
	f := Fingerprint(d.h.Sum(d.sum[:0]))
	digests.Put(d)
	return f
}

// digest is a reusable SHA-256 state and the buffers FingerprintOf passes
// to it (on the heap with it, so passing them does not allocate).
type digest struct {
	h   hash.Hash
	n   [8]byte
	sum [sha256.Size]byte
}

var digests = sync.Pool{New: func() any { return &digest{h: sha256.New()} }}

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

// String returns the key's Hash with a '#' in front, for logs and error
// text: idem never writes a raw key (which may hold an e-mail address, an
// order number or a principal) to a log line, a span or an error message.
// Use Scope and ID for the raw values.
func (k Key) String() string { return "#" + k.Hash() }

// Hash returns a short digest of scope and id: the first 8 bytes of their
// SHA-256, in hex. It is stable across processes and versions, so a log
// line can be matched to a key by hashing the key the same way (HashKey),
// but it is not a secret: a guessable id (a small order number) can be
// found by trying candidates. It keeps raw keys out of logs; it does not
// anonymise them.
func (k Key) Hash() string { return HashKey(k.Scope, k.ID) }

// HashKey returns Key{Scope: scope, ID: id}.Hash(). An adapter that logs a
// message id outside any scope passes an empty scope.
func HashKey(scope, id string) string {
	h := sha256.New()
	h.Write([]byte(scope))
	h.Write([]byte{0})
	h.Write([]byte(id))
	var sum [sha256.Size]byte
	return hex.EncodeToString(h.Sum(sum[:0])[:8])
}

// LogValue makes slog print the key's Hash, never the key.
func (k Key) LogValue() slog.Value { return slog.StringValue(k.Hash()) }

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
