package httpidem

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"hash"
	"io"
	"net/http"
	"strings"
	"sync"
	"unicode"
	"unicode/utf8"

	"github.com/idemkit/idem/dedup"
)

// requestFingerprint is the default Options.Fingerprint: SHA-256 over the
// method, the route, the request target (path and query, as sent) and the
// body byte for byte. Each part is length-prefixed exactly as
// dedup.FingerprintOf does, so moving bytes from one part to the next
// changes the fingerprint.
func requestFingerprint(r *http.Request, route string, body []byte) dedup.Fingerprint {
	return fingerprint(r.Method, route, r.URL.RequestURI(), body)
}

// FingerprintJSON is the default Options.Fingerprint with the body
// canonicalised first when it
// is one JSON value: object members sorted by name, insignificant
// whitespace removed, strings re-escaped in one way. Two bodies that encode
// the same JSON value then have the same fingerprint, so a client that
// rebuilds its request (members in another order, other spacing) on a
// retry is not refused with 422. Numbers are compared as written (1.0 and 1
// differ); for duplicate member names the last one counts, as in
// encoding/json. A body that is not valid JSON is hashed as it is, and so
// is one with an object whose member names differ only in case
// ({"amount":1,"Amount":2}): encoding/json matches a struct field's name
// without regard to case and keeps the last match, so the order of such
// members decides what a Go handler reads, and sorting them would make two
// different payments one.
func FingerprintJSON(r *http.Request, route string, body []byte) dedup.Fingerprint {
	if c, ok := canonicalJSON(body); ok {
		body = c
	}
	return fingerprint(r.Method, route, r.URL.RequestURI(), body)
}

// canonicalJSON returns the canonical form of body (see FingerprintJSON)
// and true, or nil and false when body is not exactly one JSON value or has
// an object whose member names are equal under case folding (then no
// canonical form is safe: their order matters to encoding/json).
// canonicalJSON of a canonical form returns it unchanged.
func canonicalJSON(body []byte) ([]byte, bool) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, false
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, false // trailing data
	}
	if foldedNames(v) {
		return nil, false
	}
	var out bytes.Buffer
	enc := json.NewEncoder(&out)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, false
	}
	return bytes.TrimSuffix(out.Bytes(), []byte{'\n'}), true
}

// foldedNames reports whether an object in v has two member names that are
// equal under Unicode case folding (strings.EqualFold, the rule by which
// encoding/json matches struct fields). Members with the very same name are
// one entry of the decoded map already: the last one, as encoding/json
// keeps it.
func foldedNames(v any) bool {
	switch v := v.(type) {
	case map[string]any:
		var seen map[string]struct{}
		for name, mv := range v {
			if len(v) > 1 {
				if seen == nil {
					seen = make(map[string]struct{}, len(v))
				}
				f := foldName(name)
				if _, dup := seen[f]; dup {
					return true
				}
				seen[f] = struct{}{}
			}
			if foldedNames(mv) {
				return true
			}
		}
	case []any:
		for _, e := range v {
			if foldedNames(e) {
				return true
			}
		}
	}
	return false
}

// foldName maps each rune of s to the smallest rune of its case-folding
// orbit (unicode.SimpleFold), so that foldName(a) == foldName(b) exactly
// when strings.EqualFold(a, b).
func foldName(s string) string {
	ascii := true
	for i := 0; i < len(s) && ascii; i++ {
		ascii = s[i] < utf8.RuneSelf
	}
	if ascii {
		// An ASCII letter's orbit starts with its upper case (k and s
		// have non-ASCII members too, the Kelvin sign and the long s,
		// but above K and S).
		return strings.ToUpper(s)
	}
	var b strings.Builder
	b.Grow(len(s))
	for _, r := range s {
		m := r
		for f := unicode.SimpleFold(r); f != r; f = unicode.SimpleFold(f) {
			m = min(m, f)
		}
		b.WriteRune(m)
	}
	return b.String()
}

// fingerprint hashes the parts like dedup.FingerprintOf, without converting
// the strings to byte slices and without allocating: it runs on every
// request, replays included.
func fingerprint(method, route, target string, body []byte) dedup.Fingerprint {
	d := digests.Get().(*digest)
	d.h.Reset()
	d.writeString(method)
	d.writeString(route)
	d.writeString(target)
	d.writeLen(len(body))
	d.h.Write(body)
	f := dedup.Fingerprint(d.h.Sum(d.sum[:0]))
	if cap(d.buf) > maxDigestBuf {
		d.buf = nil // a huge route or target: do not keep its copy
	}
	digests.Put(d)
	return f
}

// maxDigestBuf bounds the string buffer a pooled digest keeps.
const maxDigestBuf = 4 << 10

// digest is a reusable SHA-256 state with the buffers fingerprint passes to
// it. They live on the heap with it: a hash.Hash takes byte slices through
// an interface, so a buffer on the stack (or a string converted in place)
// would be copied to the heap on every call.
type digest struct {
	h   hash.Hash
	n   [8]byte
	sum [sha256.Size]byte
	buf []byte
}

var digests = sync.Pool{New: func() any { return &digest{h: sha256.New(), buf: make([]byte, 0, 256)} }}

// writeLen writes n as the 8-byte little-endian length prefix.
func (d *digest) writeLen(n int) {
	binary.LittleEndian.PutUint64(d.n[:], uint64(n))
	d.h.Write(d.n[:])
}

// writeString writes s with its length prefix, through d.buf.
func (d *digest) writeString(s string) {
	d.writeLen(len(s))
	d.buf = append(d.buf[:0], s...)
	d.h.Write(d.buf)
}
