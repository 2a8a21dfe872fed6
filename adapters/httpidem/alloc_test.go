//go:build !race

// The race detector changes what allocates (sync.Pool drops items at
// random under it), so these counts hold in normal builds only.

package httpidem

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemkit/idem/dedup"
)

// headerWriter is a ResponseWriter whose header map is reused, so that a
// count of allocations is the replay's own.
type headerWriter struct{ h http.Header }

func (w *headerWriter) Header() http.Header         { return w.h }
func (w *headerWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *headerWriter) WriteHeader(int)             {}

// The steps every replay takes allocate only what they hand on: the
// fingerprint nothing, the stored record its struct and one string for its
// header fields, the replay one slice for the values it adds to the
// response's header, the body read its buffer and the two readers put
// back, and the stored result of a duplicate nothing.
func TestReplayPathAllocations(t *testing.T) {
	body := []byte(`{"amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}`)
	check := func(name string, want float64, f func()) {
		t.Helper()
		if got := testing.AllocsPerRun(200, f); got > want {
			t.Errorf("%s: %v allocations, want at most %v", name, got, want)
		}
	}
	check("fingerprint", 0, func() { fingerprint(http.MethodPost, "/payments", "/payments", body) })

	h := http.Header{}
	h.Set("Content-Type", "application/json")
	h.Set("Location", "/payments/1")
	stored := encodeResponse(http.StatusCreated, h, defaultReplayHeaders, []byte(`{"id":1}`))
	check("decodeRecord", 2, func() { _, _ = decodeRecord(stored) })

	rec, err := decodeRecord(stored)
	if err != nil {
		t.Fatal(err)
	}
	w := &headerWriter{h: http.Header{}}
	replay(w, rec) // the map's room
	check("replay", 1, func() {
		clear(w.h)
		replay(w, rec)
	})

	r := httptest.NewRequest(http.MethodPost, "/payments", nil)
	src := strings.NewReader("")
	rc := io.NopCloser(src)
	text := string(body)
	check("readBody", 3, func() {
		src.Reset(text)
		r.Body, r.ContentLength = rc, int64(len(text))
		_, _ = readBody(r, defaultMaxBodyBytes)
	})

	dup := &dedup.ClaimError{Err: dedup.ErrDuplicate, Key: dedup.Key{Scope: "s", ID: "k"}, Result: stored}
	check("dedup.StoredResult", 0, func() { _, _ = dedup.StoredResult(dup) })
}
