package httpidem

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/idemkit/idem/dedup"
)

// Header names: the request's Idempotency-Key, and Idempotent-Replayed,
// set to "true" on a response that replays a stored one.
const (
	headerKey      = "Idempotency-Key"
	headerReplayed = "Idempotent-Replayed"
)

// ErrInvalidKey is wrapped by the errors ParseKey returns.
var ErrInvalidKey = errors.New("httpidem: invalid Idempotency-Key")

// ParseKey parses one Idempotency-Key field value and returns the key.
//
// The value is accepted in two forms:
//
//   - a Structured Field String (RFC 8941 §3.3.3), as the IETF draft
//     specifies: "8e03978e-40d5-43e8-bc93-6894a57f9324", with \" and \\
//     escapes and optional parameters after it (parsed and ignored);
//   - a bare key, as most clients send it: 8e03978e-40d5-43e8-bc93-6894a57f9324,
//     made of visible ASCII characters other than DQUOTE and comma.
//
// Surrounding spaces and tabs are trimmed. The key is refused when it is
// empty, longer than maxLen bytes (zero or less means
// dedup.DefaultMaxKeyLen) or holds anything else: control bytes, non-ASCII
// bytes, spaces in a bare key. The error wraps ErrInvalidKey.
func ParseKey(value string, maxLen int) (string, error) {
	if maxLen <= 0 {
		maxLen = dedup.DefaultMaxKeyLen
	}
	v := strings.Trim(value, " \t")
	if v == "" {
		return "", fmt.Errorf("%w: the value is empty", ErrInvalidKey)
	}
	if v[0] != '"' {
		return parseBareKey(v, maxLen)
	}
	key, rest, err := parseSFString(v, maxLen)
	if err != nil {
		return "", err
	}
	if err := parseParams(rest); err != nil {
		return "", err
	}
	if key == "" {
		return "", fmt.Errorf("%w: the string is empty", ErrInvalidKey)
	}
	return key, nil
}

func parseBareKey(v string, maxLen int) (string, error) {
	if len(v) > maxLen {
		return "", fmt.Errorf("%w: the key is %d bytes, the limit is %d", ErrInvalidKey, len(v), maxLen)
	}
	for i := 0; i < len(v); i++ {
		c := v[i]
		if c <= 0x20 || c >= 0x7f || c == '"' || c == ',' {
			return "", fmt.Errorf("%w: byte %#x at offset %d is not allowed in a bare key (send the key as a quoted string, or use visible ASCII other than '\"' and ',')", ErrInvalidKey, c, i)
		}
	}
	return v, nil
}

// parseSFString parses an sf-string at the start of v and returns its value
// and the rest of v.
func parseSFString(v string, maxLen int) (string, string, error) {
	var b strings.Builder
	escaped := false
	for i := 1; i < len(v); i++ {
		c := v[i]
		switch {
		case escaped:
			if c != '"' && c != '\\' {
				return "", "", fmt.Errorf("%w: invalid escape \\%c at offset %d", ErrInvalidKey, c, i)
			}
			escaped = false
			b.WriteByte(c)
		case c == '\\':
			escaped = true
			continue
		case c == '"':
			return b.String(), v[i+1:], nil
		case c < 0x20 || c > 0x7e:
			return "", "", fmt.Errorf("%w: byte %#x at offset %d is not allowed in a string", ErrInvalidKey, c, i)
		default:
			b.WriteByte(c)
		}
		if b.Len() > maxLen {
			return "", "", fmt.Errorf("%w: the key is longer than the limit of %d bytes", ErrInvalidKey, maxLen)
		}
	}
	return "", "", fmt.Errorf("%w: unterminated string", ErrInvalidKey)
}

// parseParams checks RFC 8941 parameters (;key[=bare-item]...) after the
// string, and the end of the value. The draft defines no parameter, so they
// are ignored.
func parseParams(s string) error {
	for s != "" {
		if s[0] != ';' {
			return fmt.Errorf("%w: unexpected %q after the string", ErrInvalidKey, s)
		}
		s = strings.TrimLeft(s[1:], " ")
		if s == "" || (!isLcAlpha(s[0]) && s[0] != '*') {
			return fmt.Errorf("%w: malformed parameter", ErrInvalidKey)
		}
		i := 1
		for i < len(s) && (isLcAlpha(s[i]) || isDigit(s[i]) || strings.IndexByte("_-.*", s[i]) >= 0) {
			i++
		}
		s = s[i:]
		if s == "" || s[0] != '=' {
			continue // boolean true
		}
		rest, err := skipBareItem(s[1:])
		if err != nil {
			return err
		}
		s = rest
	}
	return nil
}

// skipBareItem skips one RFC 8941 bare item (integer, decimal, string,
// token, byte sequence or boolean) and returns what follows it.
func skipBareItem(s string) (string, error) {
	bad := fmt.Errorf("%w: malformed parameter value", ErrInvalidKey)
	if s == "" {
		return "", bad
	}
	switch c := s[0]; {
	case c == '"':
		_, rest, err := parseSFString(s, 1<<16)
		return rest, err
	case c == '-' || isDigit(c):
		i := 0
		if c == '-' {
			i = 1
		}
		start, dot := i, false
		for i < len(s) && (isDigit(s[i]) || (s[i] == '.' && !dot)) {
			dot = dot || s[i] == '.'
			i++
		}
		if i == start || s[i-1] == '.' || i-start > 16 {
			return "", bad
		}
		return s[i:], nil
	case c == '?':
		if len(s) < 2 || (s[1] != '0' && s[1] != '1') {
			return "", bad
		}
		return s[2:], nil
	case c == ':':
		end := strings.IndexByte(s[1:], ':')
		if end < 0 {
			return "", bad
		}
		for _, r := range s[1 : end+1] {
			if c := byte(r); !isAlpha(c) && !isDigit(c) && c != '+' && c != '/' && c != '=' {
				return "", bad
			}
		}
		return s[end+2:], nil
	case isAlpha(c) || c == '*':
		i := 1
		for i < len(s) && (isTchar(s[i]) || s[i] == ':' || s[i] == '/') {
			i++
		}
		return s[i:], nil
	}
	return "", bad
}

func isLcAlpha(c byte) bool { return c >= 'a' && c <= 'z' }
func isAlpha(c byte) bool   { return isLcAlpha(c) || (c >= 'A' && c <= 'Z') }
func isDigit(c byte) bool   { return c >= '0' && c <= '9' }

// isTchar reports whether c is an RFC 9110 token character.
func isTchar(c byte) bool {
	return isAlpha(c) || isDigit(c) || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !isTchar(s[i]) {
			return false
		}
	}
	return true
}

// keyScope returns the dedup scope of a request: its principal, method and
// route, written so that two different triples never give the same scope
// ("http:<len(principal)>:<principal>:<method>:<route>"). When that is not
// a valid key part (longer than maxLen bytes, control bytes or invalid
// UTF-8 in the principal or route), the scope is "http:sha256:" and the hex
// SHA-256 of it instead, which is always valid and still distinct.
func keyScope(principal, method, route string, maxLen int) string {
	s := "http:" + strconv.Itoa(len(principal)) + ":" + principal + ":" + method + ":" + route
	if dedup.ValidateKey(dedup.Key{Scope: s, ID: "x"}, maxLen) == nil {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return "http:sha256:" + hex.EncodeToString(sum[:])
}

// defaultRoute is the default Options.Route: the pattern that matched the
// request in a Go 1.22+ http.ServeMux (r.Pattern, such as
// "POST /payments/{id}/refunds"), or the URL path when the request did not
// go through a ServeMux before the middleware (the middleware wraps the mux
// instead of the route's handler).
func defaultRoute(r *http.Request) string {
	if r.Pattern != "" {
		return r.Pattern
	}
	return r.URL.Path
}
