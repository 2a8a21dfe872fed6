package httpidem

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"hash"
	"io"
	"net/http"

	"github.com/idemkit/idem/dedup"
)

// Fingerprint is the default Options.Fingerprint: SHA-256 over the method,
// the route, the request target (path and query, as sent) and the body
// byte for byte. Each part is length-prefixed exactly as dedup.FingerprintOf
// does, so moving bytes from one part to the next changes the fingerprint.
//
// The request target is included because the route is usually a pattern:
// a key reused on POST /payments/1/refunds and POST /payments/2/refunds
// (same pattern, same body) is a conflict (422), not a replay of the wrong
// refund.
func Fingerprint(r *http.Request, route string, body []byte) dedup.Fingerprint {
	return fingerprint(r.Method, route, r.URL.RequestURI(), body)
}

// FingerprintJSON is Fingerprint with the body canonicalised first when it
// is one JSON value: object members sorted by name, insignificant
// whitespace removed, strings re-escaped in one way. Two bodies that encode
// the same JSON value then have the same fingerprint, so a client that
// rebuilds its request (members in another order, other spacing) on a
// retry is not refused with 422. Numbers are compared as written (1.0 and 1
// differ); for duplicate member names the last one counts, as in
// encoding/json. A body that is not valid JSON is hashed as it is.
func FingerprintJSON(r *http.Request, route string, body []byte) dedup.Fingerprint {
	if c, ok := CanonicalJSON(body); ok {
		body = c
	}
	return fingerprint(r.Method, route, r.URL.RequestURI(), body)
}

// CanonicalJSON returns the canonical form of body (see FingerprintJSON)
// and true, or nil and false when body is not exactly one JSON value.
// CanonicalJSON of a canonical form returns it unchanged.
func CanonicalJSON(body []byte) ([]byte, bool) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, false
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, false // trailing data
	}
	var out bytes.Buffer
	enc := json.NewEncoder(&out)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, false
	}
	return bytes.TrimSuffix(out.Bytes(), []byte{'\n'}), true
}

// fingerprint hashes the parts like dedup.FingerprintOf, without converting
// the strings to byte slices.
func fingerprint(method, route, target string, body []byte) dedup.Fingerprint {
	h := sha256.New()
	writeLen(h, len(method))
	_, _ = io.WriteString(h, method)
	writeLen(h, len(route))
	_, _ = io.WriteString(h, route)
	writeLen(h, len(target))
	_, _ = io.WriteString(h, target)
	writeLen(h, len(body))
	h.Write(body)
	var f dedup.Fingerprint
	h.Sum(f[:0])
	return f
}

func writeLen(h hash.Hash, n int) {
	var b [8]byte
	l := uint64(n)
	for i := range b {
		b[i] = byte(l >> (8 * i))
	}
	h.Write(b[:])
}
