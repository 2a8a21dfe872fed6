package httpidem

// Fuzz tests of the parsers and of the fingerprint's canonical form. They
// run their seed corpus with go test; fuzz them with, for example,
//
//	go test -run '^$' -fuzz FuzzParseKey -fuzztime 1m ./adapters/httpidem/

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
)

func FuzzParseKey(f *testing.F) {
	for _, s := range []string{
		"8e03978e-40d5-43e8-bc93-6894a57f9324", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`,
		`"a\"b\\c"`, `"k";a=1;b="x";c=?0;d=:AAE=:;e=tok/1;f=-1.5`, `"k";`, `"k" x`, `"`, `""`, "",
		"a,b", "a b", "k\x01", "\"k\x00\"", " \tk\t ", "ключ", strings.Repeat("k", 300),
	} {
		f.Add(s, 0)
	}
	f.Fuzz(func(t *testing.T, v string, maxLen int) {
		maxLen %= 400
		key, err := ParseKey(v, maxLen)
		if err != nil {
			if !errors.Is(err, ErrInvalidKey) {
				t.Fatalf("error %v does not wrap ErrInvalidKey", err)
			}
			return
		}
		limit := maxLen
		if limit <= 0 {
			limit = dedup.DefaultMaxKeyLen
		}
		if key == "" || len(key) > limit {
			t.Fatalf("ParseKey(%q) = %q: empty or over the limit %d", v, key, limit)
		}
		for i := 0; i < len(key); i++ {
			if key[i] < 0x20 || key[i] > 0x7e {
				t.Fatalf("ParseKey(%q) = %q: byte %#x", v, key, key[i])
			}
		}
		// Every accepted key is a valid dedup id, and survives quoting.
		if err := dedup.ValidateKey(dedup.Key{Scope: "s", ID: key}, limit); err != nil {
			t.Fatalf("ParseKey(%q) = %q, which the stores refuse: %v", v, key, err)
		}
		if again, err := ParseKey(quoteKey(key), limit); err != nil || again != key {
			t.Fatalf("quoted %q parses as %q, %v", key, again, err)
		}
	})
}

func FuzzParseSignature(f *testing.F) {
	sig := hex.EncodeToString(make([]byte, sha256.Size))
	for _, s := range []string{
		"t=1760000000,v1=" + sig, "t=1760000000, v1=" + sig + ",v1=" + sig + ",v0=zz", "v1=" + sig + ",t=1",
		"t=1760000000", "t=,v1=" + sig, "t=1,t=2,v1=" + sig, "t=1,v1=abc", "garbage", "", ",,,", "t=99999999999999999999,v1=" + sig,
	} {
		f.Add(s, []byte(`{"a":1}`), []byte("secret"), int64(1_760_000_000))
	}
	f.Fuzz(func(t *testing.T, header string, body, secret []byte, unix int64) {
		ts, n, sigs, err := parseSignature(header, "v1")
		if err == nil {
			if ts == "" || strings.Trim(ts, "0123456789") != "" || n < 0 || len(sigs) == 0 || len(sigs) > maxSignatures {
				t.Fatalf("parseSignature(%q) = %q, %d, %d signatures", header, ts, n, len(sigs))
			}
			for _, s := range sigs {
				if len(s) != sha256.Size {
					t.Fatalf("signature of %d bytes", len(s))
				}
			}
		} else if !errors.Is(err, ErrSignatureMissing) && !errors.Is(err, ErrSignatureMalformed) {
			t.Fatalf("parseSignature(%q): unexpected error %v", header, err)
		}
		// Whatever the header, verification never panics, and never
		// accepts it without a signature made with the secret.
		if len(secret) == 0 {
			return
		}
		now := time.Unix(unix&(1<<40-1), 0)
		if verifySignature(header, "v1", body, [][]byte{secret}, now, 5*time.Minute) == nil {
			if !strings.Contains(strings.ToLower(header), hex.EncodeToString(signature(secret, ts, body))) {
				t.Fatalf("%q verified without the signature", header)
			}
		}
		// A signature made with the secret verifies; one bit off does not.
		good := SignWebhook(secret, now, body)
		if err := verifySignature(good, "v1", body, [][]byte{[]byte("other"), secret}, now, time.Minute); err != nil {
			t.Fatalf("own signature %q: %v", good, err)
		}
		if err := verifySignature(good, "v1", append(bytes.Clone(body), 'x'), [][]byte{secret}, now, time.Minute); !errors.Is(err, errSignatureMismatch) {
			t.Fatalf("signature over another body: %v", err)
		}
	})
}

// FuzzFingerprint checks the fingerprint's canonical form: it is
// dedup.FingerprintOf over the parts (so stores and tools agree), two
// different splits of the same bytes never collide, FingerprintJSON equals
// for JSON bodies that only differ in formatting, and a body and its
// canonical form decode to the same Go struct.
func FuzzFingerprint(f *testing.F) {
	for _, s := range [][4]string{
		{"POST", "/payments", "/payments", `{"amount":100,"currency":"EUR"}`},
		{"POST", "POST /payments/{id}", "/payments/1?x=1", `{"b":[1,2,{"c":null}],"a":"\u00e9<>"}`},
		{"PATCH", "", "", ""},
		{"POST", "/a", "/ab", "c"},
		{"POST", "/a", "/a", `  [1.0, 2e3, "x\"y"]  `},
		{"POST", "/payments", "/payments", `{"amount":100,"Amount":200,"to":{"Iban":"x","iban":"y"}}`},
	} {
		f.Add(s[0], s[1], s[2], []byte(s[3]))
	}
	f.Fuzz(func(t *testing.T, method, route, target string, body []byte) {
		fp := fingerprint(method, route, target, body)
		if fp != dedup.FingerprintOf([]byte(method), []byte(route), []byte(target), body) {
			t.Fatal("fingerprint differs from dedup.FingerprintOf")
		}
		// Moving one byte between adjacent parts changes it.
		if route != "" {
			if fingerprint(method+route[:1], route[1:], target, body) == fp {
				t.Fatal("parts are not delimited")
			}
		}
		if len(body) > 0 {
			if fingerprint(method, route, target+string(body[:1]), body[1:]) == fp {
				t.Fatal("parts are not delimited")
			}
		}
		// Canonical JSON: a fixed point, and blind to formatting.
		c, ok := canonicalJSON(body)
		if !ok {
			var v any
			if json.Valid(body) && json.Unmarshal(body, &v) == nil && !foldedNames(v) {
				t.Fatalf("valid JSON %q was not canonicalised", body)
			}
			return
		}
		// What a Go handler reads from the body, it reads from the
		// canonical form: the fingerprint never equates two bodies a
		// handler reads differently.
		var fromBody, fromCanonical fuzzPayment
		if json.Unmarshal(body, &fromBody) == nil {
			if err := json.Unmarshal(c, &fromCanonical); err != nil || !reflect.DeepEqual(fromBody, fromCanonical) {
				t.Fatalf("%q decodes to %+v, its canonical form %q to %+v (%v)", body, fromBody, c, fromCanonical, err)
			}
		}
		if c2, ok := canonicalJSON(c); !ok || !bytes.Equal(c, c2) {
			t.Fatalf("canonical form is not a fixed point: %q → %q", c, c2)
		}
		var indented bytes.Buffer
		if err := json.Indent(&indented, body, " ", "\t"); err == nil {
			r := httptest.NewRequest(method2(method), "/x", nil)
			if FingerprintJSON(r, route, indented.Bytes()) != FingerprintJSON(r, route, body) {
				t.Fatalf("indenting %q changed FingerprintJSON", body)
			}
		}
	})
}

// fuzzPayment is a handler's request struct, for FuzzFingerprint.
type fuzzPayment struct {
	Amount json.Number
	Kind   string
	To     *struct{ Iban, Name any }
	Tags   []any
}

// method2 returns a method httptest.NewRequest accepts.
func method2(m string) string {
	if isToken(m) {
		return m
	}
	return http.MethodPost
}

// FuzzDecodeRecord: decoding a stored response never panics, whatever is
// stored, and encoding round-trips.
func FuzzDecodeRecord(f *testing.F) {
	f.Add((&record{status: 201, header: [][2]string{{"Content-Type", "application/json"}, {"Location", "/p/1"}}, body: []byte(`{"ok":true}`)}).encode())
	f.Add((&record{status: 204}).encode())
	f.Add([]byte("charged"))
	f.Add([]byte{'h', 'i', 1, 0, 200, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := decodeRecord(b)
		if err != nil {
			if !errors.Is(err, errRecord) {
				t.Fatalf("error %v does not wrap errRecord", err)
			}
			return
		}
		again, err := decodeRecord(r.encode())
		if err != nil || again.status != r.status || !bytes.Equal(again.body, r.body) || len(again.header) != len(r.header) {
			t.Fatalf("round trip: %v", err)
		}
		for i := range r.header {
			if again.header[i] != r.header[i] {
				t.Fatal("round trip changed a header")
			}
		}
		replay(httptest.NewRecorder(), r) // writable as it is
	})
}

func TestParseRetryAfter(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		v    string
		want time.Duration
		ok   bool
	}{
		{"3", 3 * time.Second, true},
		{" 0 ", 0, true},
		{"999999999", 24 * time.Hour, true},
		{"-1", 0, false},
		{"soon", 0, false},
		{"", 0, false},
		{now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second, true},
		{now.Add(-time.Hour).Format(http.TimeFormat), 0, true},
	} {
		got, ok := parseRetryAfter(tc.v, now)
		if got != tc.want || ok != tc.ok {
			t.Errorf("parseRetryAfter(%q) = %v %v, want %v %v", tc.v, got, ok, tc.want, tc.ok)
		}
	}
}

func TestBackoffFullJitter(t *testing.T) {
	t.Parallel()
	tr, err := NewTransport(TransportOptions{Backoff: consumer.Backoff{Initial: 10 * time.Millisecond, Max: 100 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	for n := 1; n <= 70; n++ {
		ceiling := min(100*time.Millisecond, 10*time.Millisecond<<min(n-1, 20))
		for range 50 {
			if d := tr.backoff(n); d < 0 || d > ceiling {
				t.Fatalf("retry %d: delay %v outside [0, %v]", n, d, ceiling)
			}
		}
	}
}

func TestScopeIsInjective(t *testing.T) {
	t.Parallel()
	seen := map[string][3]string{}
	for _, p := range []string{"", "0:", "a", "a:POST", "2:ab"} {
		for _, m := range []string{"POST", "PATCH"} {
			for _, r := range []string{"/x", "/x:2:ab", ":POST:/x", ""} {
				s := keyScope(p, m, r, 255)
				if prev, dup := seen[s]; dup {
					t.Fatalf("%q and %q share scope %q", prev, [3]string{p, m, r}, s)
				}
				seen[s] = [3]string{p, m, r}
			}
		}
	}
	long := keyScope(strings.Repeat("p", 300), "POST", "/x", 255)
	ctl := keyScope("user\n1", "POST", "/x", 255)
	if !strings.HasPrefix(long, "http:sha256:") || !strings.HasPrefix(ctl, "http:sha256:") || long == ctl {
		t.Fatalf("hashed scopes %q %q", long, ctl)
	}
	if err := dedup.ValidateKey(dedup.Key{Scope: ctl, ID: "x"}, 0); err != nil {
		t.Fatal(err)
	}
}
