package httpidem

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/idemkit/idem/dedup"
)

// A stored response with more header fields than a record holds inline,
// and several values of one field, decodes to what was encoded and replays
// every value once, in order.
func TestRecordManyFields(t *testing.T) {
	t.Parallel()
	h := http.Header{}
	names := []string{"Content-Type", "Link", "Location", "Vary", "Etag"}
	h.Set("Content-Type", "application/json")
	h.Add("Link", "</a>; rel=a")
	h.Add("Link", "</b>; rel=b")
	h.Set("Location", "/payments/1")
	h.Add("Vary", "Accept")
	h.Add("Vary", "Origin")
	h.Set("Etag", `"v1"`)
	h.Set("X-Not-Kept", "1")
	b := encodeResponse(http.StatusCreated, h, names, []byte(`{"id":1}`))
	r, err := decodeRecord(b)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.header) != 7 || r.status != http.StatusCreated || string(r.body) != `{"id":1}` {
		t.Fatalf("decoded %d fields, status %d, body %q", len(r.header), r.status, r.body)
	}
	if !bytes.Equal(r.encode(), b) {
		t.Fatal("a decoded record encodes differently")
	}
	w := httptest.NewRecorder()
	replay(w, r)
	got := w.Result().Header
	for _, name := range names {
		if strings.Join(got[name], "|") != strings.Join(h[name], "|") {
			t.Fatalf("%s replayed as %q, want %q", name, got[name], h[name])
		}
	}
	if got.Get("X-Not-Kept") != "" || got.Get(headerReplayed) != "true" || got.Get("Content-Length") != "8" {
		t.Fatalf("replayed header %v", got)
	}
}

// Replaying onto a header that already has fields (set by a middleware in
// front) adds the stored values after them, and replaces Content-Length
// and Idempotent-Replayed.
func TestReplayOntoExistingHeader(t *testing.T) {
	t.Parallel()
	h := http.Header{}
	h.Set("Vary", "Accept")
	r, err := decodeRecord(encodeResponse(http.StatusOK, h, []string{"Vary"}, []byte("hello")))
	if err != nil {
		t.Fatal(err)
	}
	w := httptest.NewRecorder()
	w.Header().Set("Vary", "Origin")
	w.Header().Set("Content-Length", "999")
	w.Header().Set(headerReplayed, "false")
	replay(w, r)
	got := w.Result().Header
	if v := got.Values("Vary"); len(v) != 2 || v[0] != "Origin" || v[1] != "Accept" {
		t.Fatalf("Vary %q, want Origin then Accept", v)
	}
	if v := got.Values("Content-Length"); len(v) != 1 || v[0] != "5" {
		t.Fatalf("Content-Length %q, want 5", v)
	}
	if v := got.Values(headerReplayed); len(v) != 1 || v[0] != "true" {
		t.Fatalf("%s %q, want true", headerReplayed, v)
	}
	// The fields a replay added are distinct slices: appending to one
	// does not change another.
	w.Header()["Content-Length"] = append(w.Header()["Content-Length"], "x")
	if got := w.Header().Values(headerReplayed); len(got) != 1 || got[0] != "true" {
		t.Fatalf("%s changed to %q by an append to another field", headerReplayed, got)
	}
}

// readBody reads bodies whatever their reader and announced length, up to
// the limit exactly, and puts them back for Body and GetBody.
func TestReadBody(t *testing.T) {
	t.Parallel()
	const limit = 1000
	for _, tc := range []struct {
		name     string
		body     string
		length   int64 // r.ContentLength
		oneByte  bool  // the reader returns one byte per Read
		tooLarge bool
	}{
		{name: "empty", body: "", length: 0},
		{name: "announced", body: "abc", length: 3},
		{name: "unknown length", body: strings.Repeat("x", 700), length: -1},
		{name: "one byte per read", body: strings.Repeat("y", 600), length: -1, oneByte: true},
		{name: "announced short", body: strings.Repeat("z", 900), length: 10},
		{name: "at the limit", body: strings.Repeat("a", limit), length: -1},
		{name: "at the limit, announced", body: strings.Repeat("a", limit), length: limit},
		{name: "one past the limit", body: strings.Repeat("b", limit+1), length: -1, tooLarge: true},
		{name: "one past, one byte per read", body: strings.Repeat("b", limit+1), length: -1, oneByte: true, tooLarge: true},
		{name: "announced past the limit", body: "c", length: limit + 1, tooLarge: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var src io.Reader = strings.NewReader(tc.body)
			if tc.oneByte {
				src = iotest.OneByteReader(src)
			}
			r := httptest.NewRequest(http.MethodPost, "/", nil)
			r.Body, r.ContentLength = io.NopCloser(src), tc.length
			data, p := readBody(r, limit)
			if tc.tooLarge {
				if p == nil || p.Status != http.StatusRequestEntityTooLarge {
					t.Fatalf("problem %v, want 413", p)
				}
				return
			}
			if p != nil || string(data) != tc.body {
				t.Fatalf("read %d bytes, problem %v; want %d bytes", len(data), p, len(tc.body))
			}
			for range 2 {
				rc, err := r.GetBody()
				if err != nil {
					t.Fatal(err)
				}
				if b, err := io.ReadAll(rc); err != nil || string(b) != tc.body {
					t.Fatalf("GetBody gave %d bytes, %v", len(b), err)
				}
			}
			if b, err := io.ReadAll(r.Body); err != nil || string(b) != tc.body || r.Body.Close() != nil {
				t.Fatalf("Body gave %d bytes, %v", len(b), err)
			}
		})
	}
	// A reader that fails is a 400, not a partial body.
	r := httptest.NewRequest(http.MethodPost, "/", nil)
	r.Body = io.NopCloser(io.MultiReader(strings.NewReader("abc"), iotest.ErrReader(errors.New("reset"))))
	if _, p := readBody(r, limit); p == nil || p.Status != http.StatusBadRequest {
		t.Fatalf("failing reader: %v, want 400", p)
	}
}

// The pooled fingerprint agrees with dedup.FingerprintOf, for parts longer
// than the buffer a pooled digest keeps too, and one call does not leak
// into the next.
func TestFingerprintPooled(t *testing.T) {
	t.Parallel()
	long := "/" + strings.Repeat("p", 3*maxDigestBuf)
	for _, tc := range [][4]string{
		{"POST", "/payments", "/payments", `{"amount":1}`},
		{"POST", long, long + "?q=1", strings.Repeat("b", 5000)},
		{"PATCH", "", "", ""},
		{"POST", "/payments", "/payments", `{"amount":1}`},
	} {
		want := dedup.FingerprintOf([]byte(tc[0]), []byte(tc[1]), []byte(tc[2]), []byte(tc[3]))
		if got := fingerprint(tc[0], tc[1], tc[2], []byte(tc[3])); got != want {
			t.Fatalf("fingerprint of %.20q differs from dedup.FingerprintOf", tc)
		}
	}
}

// FingerprintJSON never equates two bodies that a Go handler decodes
// differently: encoding/json matches member names to struct fields without
// regard to case and keeps the last match, so {"amount":100,"Amount":200}
// is a payment of 200 and {"Amount":200,"amount":100} one of 100. Such
// bodies are hashed as they are; ordinary ones still canonically.
func TestFingerprintJSONCaseFoldedNames(t *testing.T) {
	t.Parallel()
	type payment struct{ Amount int }
	r := httptest.NewRequest(http.MethodPost, "/payments", nil)
	for _, pair := range [][2]string{
		{`{"amount":100,"Amount":200}`, `{"Amount":200,"amount":100}`},
		{`{"to":{"amount":100,"AMOUNT":200}}`, `{"to":{"AMOUNT":200,"amount":100}}`},
		{`[{"Kind":1,"kind":2}]`, `[{"kind":2,"Kind":1}]`},
		{`{"k":1,"\u212a":2}`, `{"\u212a":2,"k":1}`}, // the Kelvin sign folds to k
	} {
		a, b := []byte(pair[0]), []byte(pair[1])
		if FingerprintJSON(r, "/payments", a) == FingerprintJSON(r, "/payments", b) {
			t.Errorf("%s and %s share a fingerprint", a, b)
		}
		if _, ok := canonicalJSON(a); ok {
			t.Errorf("canonicalJSON(%s) gave a canonical form", a)
		}
	}
	var p1, p2 payment
	if err := errors.Join(json.Unmarshal([]byte(`{"amount":100,"Amount":200}`), &p1),
		json.Unmarshal([]byte(`{"Amount":200,"amount":100}`), &p2)); err != nil || p1 == p2 {
		t.Fatalf("encoding/json read %+v and %+v (%v): the premise of this test no longer holds", p1, p2, err)
	}
	// Members whose names differ other than in case are still sorted, and
	// an exact repeat keeps the last value, as encoding/json does.
	for _, pair := range [][2]string{
		{`{"amount":100,"currency":"EUR"}`, `{ "currency":"EUR", "amount":100 }`},
		{`{"amount":1,"amount":100}`, `{"amount":100}`},
	} {
		if FingerprintJSON(r, "/payments", []byte(pair[0])) != FingerprintJSON(r, "/payments", []byte(pair[1])) {
			t.Errorf("%s and %s have different fingerprints", pair[0], pair[1])
		}
	}
}
