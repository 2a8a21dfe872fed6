package httpidem_test

import (
	"github.com/jackc/pgx/v5"

	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/testkit/clocktest"
)

func TestReplayAfterCompletion(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	h := &countingHandler{}
	srv := quietServer(t, newMW(t, store, httpidem.Options{}).Handler(h))

	first := do(t, nil, srv.URL, req{key: "k-1", body: `{"amount":100}`})
	if first.status != http.StatusCreated || first.replayed() {
		t.Fatalf("first: %d replayed=%v %s", first.status, first.replayed(), first.body)
	}
	if first.header.Get("X-Request-Serial") != "1" {
		t.Fatalf("first response lost the handler's headers: %v", first.header)
	}
	for range 3 {
		again := do(t, nil, srv.URL, req{key: "k-1", body: `{"amount":100}`})
		if again.status != http.StatusCreated || !again.replayed() {
			t.Fatalf("retry: %d replayed=%v", again.status, again.replayed())
		}
		if !bytes.Equal(again.body, first.body) {
			t.Fatalf("replayed body %q, first %q", again.body, first.body)
		}
		if again.header.Get("Location") != first.header.Get("Location") || again.header.Get("Content-Type") != "application/json" {
			t.Fatalf("replay lost stored headers: %v", again.header)
		}
		if again.header.Get("X-Request-Serial") != "" {
			t.Fatalf("a header outside ReplayHeaders was replayed: %v", again.header)
		}
	}
	if n := h.calls.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
	// Quoted (RFC 8941 string) and bare forms are the same key.
	q := do(t, nil, srv.URL, req{key: `"k-1"`, body: `{"amount":100}`})
	if !q.replayed() {
		t.Fatalf("the quoted form of the key was not replayed: %d", q.status)
	}
	// Another key runs the handler again.
	if other := do(t, nil, srv.URL, req{key: "k-2", body: `{"amount":100}`}); other.replayed() || h.calls.Load() != 2 {
		t.Fatalf("another key: replayed=%v calls=%d", other.replayed(), h.calls.Load())
	}
}

func TestMissingKey(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	h := &countingHandler{}
	srv := quietServer(t, newMW(t, store, httpidem.Options{}).Handler(h))

	for _, method := range []string{http.MethodPost, http.MethodPatch} {
		r := do(t, nil, srv.URL, req{method: method, body: "{}"})
		if r.status != http.StatusBadRequest {
			t.Fatalf("%s without key: %d", method, r.status)
		}
		if p := r.problem(t); p.Type != problemKeyMissing {
			t.Fatalf("problem type %q", p.Type)
		}
	}
	// Methods outside Options.Methods pass through, key or not.
	for _, method := range []string{http.MethodGet, http.MethodPut, http.MethodDelete} {
		if r := do(t, nil, srv.URL, req{method: method}); r.status != http.StatusCreated {
			t.Fatalf("%s passed through: %d", method, r.status)
		}
	}
	if n := h.calls.Load(); n != 3 || store.Len() != 0 {
		t.Fatalf("calls %d, store entries %d; want 3 and 0", n, store.Len())
	}

	// Optional: a request without a key runs without deduplication.
	var outcomes []consumer.Outcome
	var mu sync.Mutex
	opt := quietServer(t, newMW(t, store, httpidem.Options{Optional: true,
		Telemetry: consumer.Telemetry{
			OnOutcome: func(_ context.Context, rep consumer.Report) {
				mu.Lock()
				outcomes = append(outcomes, rep.Outcome)
				mu.Unlock()
			},
		}}).Handler(h))
	for range 2 {
		if r := do(t, nil, opt.URL, req{body: "{}"}); r.status != http.StatusCreated || r.replayed() {
			t.Fatalf("optional key: %d", r.status)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(outcomes) != 2 || outcomes[0] != consumer.OutcomePassed {
		t.Fatalf("outcomes %v", outcomes)
	}
}

func TestInvalidKeys(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	h := &countingHandler{}
	mw := newMW(t, store, httpidem.Options{})
	srv := quietServer(t, mw.Handler(h))

	long := strings.Repeat("k", 10<<10)
	for _, key := range []string{
		long,                     // 10 KB
		`"` + long + `"`,         // 10 KB, quoted
		strings.Repeat("k", 256), // one byte over the limit
		`"unterminated`,
		`"bad \n escape"`,
		`"ok" trailing`,
		`two words`,
		`a,b`,
		`""`,
	} {
		r := do(t, nil, srv.URL, req{key: key, body: "{}"})
		if r.status != http.StatusBadRequest || r.problem(t).Type != problemKeyInvalid {
			t.Fatalf("key %.40q: %d %s", key, r.status, r.body)
		}
	}
	// A client refuses to send control bytes; a raw request, or a
	// handler called directly, can.
	for _, key := range []string{"k\x01y", "k\x7fy", "\"k\x01y\"", "k\ty", "ключ"} {
		r := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader("{}"))
		r.Header.Set("Idempotency-Key", key)
		resp := serveDirect(mw.Handler(h), r)
		if resp.status != http.StatusBadRequest || resp.problem(t).Type != problemKeyInvalid {
			t.Fatalf("key %q: %d %s", key, resp.status, resp.body)
		}
	}
	raw := rawRequest(t, srv.URL, "POST /payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k\x01y\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
	if !strings.HasPrefix(raw, "HTTP/1.1 400") {
		t.Fatalf("raw request with a control byte in the key: %q", raw)
	}
	// Two fields.
	r := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader("{}"))
	r.Header.Add("Idempotency-Key", "a")
	r.Header.Add("Idempotency-Key", "b")
	if resp := serveDirect(mw.Handler(h), r); resp.status != http.StatusBadRequest {
		t.Fatalf("two key fields: %d", resp.status)
	}
	if n := h.calls.Load(); n != 0 || store.Len() != 0 {
		t.Fatalf("handler ran %d times, store has %d entries; want 0 and 0", n, store.Len())
	}
	// A quoted key with escapes and parameters is fine.
	if resp := do(t, nil, srv.URL, req{key: `"a\"b\\c";x=1;y`, body: "{}"}); resp.status != http.StatusCreated {
		t.Fatalf("quoted key with escapes: %d %s", resp.status, resp.body)
	}
}

func rawRequest(t *testing.T, url, request string) string {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := io.WriteString(conn, request); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	return line
}

func TestSameKeyOtherRequest(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	h := &countingHandler{}
	mux := http.NewServeMux()
	mw := newMW(t, store, httpidem.Options{})
	mux.Handle("POST /payments/{id}/refunds", mw.Handler(h))
	mux.Handle("POST /payments", mw.Handler(h))
	srv := quietServer(t, mux)

	if r := do(t, nil, srv.URL, req{key: "k", body: `{"amount":100}`}); r.status != http.StatusCreated {
		t.Fatal(r.status)
	}
	r := do(t, nil, srv.URL, req{key: "k", body: `{"amount":999}`})
	if r.status != http.StatusUnprocessableEntity || r.problem(t).Type != problemKeyReused {
		t.Fatalf("other body: %d %s", r.status, r.body)
	}
	// Same pattern, other path: a conflict, not the other refund's replay.
	if r := do(t, nil, srv.URL, req{key: "rk", path: "/payments/1/refunds", body: `{}`}); r.status != http.StatusCreated {
		t.Fatal(r.status)
	}
	if r := do(t, nil, srv.URL, req{key: "rk", path: "/payments/2/refunds", body: `{}`}); r.status != http.StatusUnprocessableEntity {
		t.Fatalf("other path, same pattern: %d", r.status)
	}
	// Another route is another scope: the same key is a new request there.
	if r := do(t, nil, srv.URL, req{key: "k", path: "/payments/1/refunds", body: `{"amount":100}`}); r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("same key on another route: %d replayed=%v", r.status, r.replayed())
	}
	if n := h.calls.Load(); n != 3 {
		t.Fatalf("calls %d, want 3", n)
	}
}

func TestPrincipalsDoNotShareKeys(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	h := &countingHandler{}
	mw := newMW(t, store, httpidem.Options{Principal: func(r *http.Request) string { return r.Header.Get("X-User") }})
	srv := quietServer(t, mw.Handler(h))
	alice := do(t, nil, srv.URL, req{key: "same", body: "{}", header: map[string]string{"X-User": "alice"}})
	bob := do(t, nil, srv.URL, req{key: "same", body: "{}", header: map[string]string{"X-User": "bob"}})
	if alice.replayed() || bob.replayed() || bytes.Equal(alice.body, bob.body) {
		t.Fatalf("bob got alice's response: %s / %s", alice.body, bob.body)
	}
	again := do(t, nil, srv.URL, req{key: "same", body: "{}", header: map[string]string{"X-User": "bob"}})
	if !again.replayed() || !bytes.Equal(again.body, bob.body) {
		t.Fatalf("bob's retry: %s", again.body)
	}
	if n := h.calls.Load(); n != 2 {
		t.Fatalf("calls %d, want 2", n)
	}
}

func TestBodyTooLarge(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	h := &countingHandler{}
	srv := quietServer(t, newMW(t, store, httpidem.Options{}).Handler(h))
	big := strings.Repeat("x", 10<<20)
	r := do(t, nil, srv.URL, req{key: "big", body: big})
	if r.status != http.StatusRequestEntityTooLarge || r.problem(t).Type != problemBodyTooLarge {
		t.Fatalf("10 MB body: %d", r.status)
	}
	// Without a Content-Length (chunked): read up to the limit, then 413.
	pr, pw := io.Pipe()
	go func() {
		_, _ = io.Copy(pw, io.LimitReader(zeros{}, 2<<20))
		_ = pw.Close()
	}()
	rq, _ := http.NewRequest(http.MethodPost, srv.URL+"/payments", pr)
	rq.Header.Set("Idempotency-Key", "chunked")
	resp, err := http.DefaultClient.Do(rq)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Fatalf("chunked 2 MiB body: %d", resp.StatusCode)
	}
	if n := h.calls.Load(); n != 0 || store.Len() != 0 {
		t.Fatalf("calls %d, store entries %d: something was stored", n, store.Len())
	}
	// The limit is configurable, and the body reaches the handler whole.
	srv2 := quietServer(t, newMW(t, store, httpidem.Options{MaxBodyBytes: 11 << 20, MaxResponseBytes: 21 << 20}).Handler(h))
	r = do(t, nil, srv2.URL, req{key: "big", body: big})
	var got struct{ Echo string }
	if err := json.Unmarshal(r.body, &got); err != nil || r.status != http.StatusCreated || got.Echo != big {
		t.Fatalf("10 MB body under an 11 MiB limit: %d, echo %d bytes", r.status, len(got.Echo))
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

func TestPanicReleasesKey(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	var calls atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			panic("boom before writing")
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "ok")
	})
	var reports []consumer.Outcome
	var mu sync.Mutex
	mw := newMW(t, store, httpidem.Options{
		Telemetry: consumer.Telemetry{
			OnOutcome: func(_ context.Context, rep consumer.Report) {
				mu.Lock()
				reports = append(reports, rep.Outcome)
				mu.Unlock()
			},
		},
	})
	// The panic goes on to the server (which closes the connection).
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("the panic was swallowed")
			}
		}()
		r := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader("{}"))
		r.Header.Set("Idempotency-Key", "p")
		serveDirect(mw.Handler(h), r)
	}()
	srv := quietServer(t, mw.Handler(h))
	r := do(t, nil, srv.URL, req{key: "p", body: "{}"})
	if r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("retry after a panic: %d replayed=%v", r.status, r.replayed())
	}
	if r := do(t, nil, srv.URL, req{key: "p", body: "{}"}); !r.replayed() {
		t.Fatal("the retry's response was not stored")
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(reports) != "[released completed duplicate]" {
		t.Fatalf("outcomes %v", reports)
	}
}

func TestWhichResponsesAreStored(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	var calls atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		switch r.URL.Path {
		case "/release": // a validation error: nothing happened
			httpidem.Release(r.Context())
			http.Error(w, "amount must be positive", http.StatusBadRequest)
		case "/401":
			w.WriteHeader(http.StatusUnauthorized)
		case "/429":
			w.WriteHeader(http.StatusTooManyRequests)
		case "/500":
			http.Error(w, "gateway said no", http.StatusInternalServerError)
		case "/empty": // wrote nothing: an implicit 200
		}
	})
	srv := quietServer(t, newMW(t, store, httpidem.Options{}).Handler(h))
	for _, tc := range []struct {
		path   string
		status int
		stored bool
	}{
		{"/release", 400, false}, {"/401", 401, false}, {"/429", 429, false},
		{"/500", 500, true}, {"/empty", 200, true},
	} {
		before := calls.Load()
		for i := range 2 {
			r := do(t, nil, srv.URL, req{path: tc.path, key: "k" + tc.path, body: "{}"})
			if r.status != tc.status {
				t.Fatalf("%s attempt %d: status %d, want %d", tc.path, i, r.status, tc.status)
			}
			if i == 1 && r.replayed() != tc.stored {
				t.Fatalf("%s: replayed=%v, want stored=%v", tc.path, r.replayed(), tc.stored)
			}
		}
		want := int64(2)
		if tc.stored {
			want = 1
		}
		if got := calls.Load() - before; got != want {
			t.Fatalf("%s: handler ran %d times, want %d", tc.path, got, want)
		}
	}
	// A custom rule: store 2xx only.
	srv2 := quietServer(t, newMW(t, store, httpidem.Options{StoreResponse: func(s int) bool { return s < 300 }}).Handler(h))
	do(t, nil, srv2.URL, req{path: "/500", key: "x", body: "{}"})
	if r := do(t, nil, srv2.URL, req{path: "/500", key: "x", body: "{}"}); r.replayed() {
		t.Fatal("a 500 was stored although StoreResponse refused it")
	}
}

func TestInFlightAnswers409(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	entered, unblock := make(chan struct{}), make(chan struct{})
	var calls atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		close(entered)
		<-unblock
		w.WriteHeader(http.StatusCreated)
	})
	srv := quietServer(t, newMW(t, store, httpidem.Options{RetryAfter: 1500 * time.Millisecond}).Handler(h))
	done := make(chan response)
	go func() {
		r, _ := send(context.Background(), nil, srv.URL, req{key: "slow", body: "{}"})
		done <- r
	}()
	<-entered
	r := do(t, nil, srv.URL, req{key: "slow", body: "{}"})
	if r.status != http.StatusConflict || r.header.Get("Retry-After") != "2" || r.problem(t).Type != problemInProgress {
		t.Fatalf("in flight: %d Retry-After %q", r.status, r.header.Get("Retry-After"))
	}
	close(unblock)
	if first := <-done; first.status != http.StatusCreated {
		t.Fatalf("first: %d", first.status)
	}
	if r := do(t, nil, srv.URL, req{key: "slow", body: "{}"}); !r.replayed() || calls.Load() != 1 {
		t.Fatalf("after the first finished: %d replayed=%v calls=%d", r.status, r.replayed(), calls.Load())
	}
}

func TestWaitForFirst(t *testing.T) {
	t.Parallel()
	mem := newMem(t, memstore.Options{})
	store := &hookStore{LeaseStore: mem}
	waiting := make(chan struct{}, 100)
	store.onClaim = func(err error) {
		if errors.Is(err, dedup.ErrInFlight) {
			waiting <- struct{}{}
		}
	}
	entered, unblock := make(chan struct{}), make(chan struct{})
	h := &countingHandler{}
	slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		<-unblock
		h.ServeHTTP(w, r)
	})
	var waited atomic.Int64
	mw := newMW(t, store, httpidem.Options{Wait: time.Minute, PollInterval: time.Millisecond,
		Telemetry: consumer.Telemetry{
			OnOutcome: func(_ context.Context, rep consumer.Report) {
				if rep.Outcome == consumer.OutcomeDuplicate && rep.Waited > 0 {
					waited.Add(1)
				}
			},
		},
	})
	srv := quietServer(t, mw.Handler(slow))
	first := make(chan response)
	go func() {
		r, _ := send(context.Background(), nil, srv.URL, req{key: "w", body: "{}"})
		first <- r
	}()
	<-entered
	second := make(chan response)
	go func() {
		r, _ := send(context.Background(), nil, srv.URL, req{key: "w", body: "{}"})
		second <- r
	}()
	<-waiting // the second request saw the key in flight and waits
	close(unblock)
	a, b := <-first, <-second
	if a.status != http.StatusCreated || a.replayed() || b.status != http.StatusCreated || !b.replayed() || !bytes.Equal(a.body, b.body) {
		t.Fatalf("first %d %s, waiting second %d replayed=%v %s", a.status, a.body, b.status, b.replayed(), b.body)
	}
	if h.calls.Load() != 1 || waited.Load() != 1 {
		t.Fatalf("calls %d, waited replays %d", h.calls.Load(), waited.Load())
	}
}

func TestResponseTooLargeLease(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	var calls atomic.Int64
	var writeErr error
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.WriteHeader(http.StatusCreated)
		_, writeErr = w.Write(make([]byte, 2048))
	})
	srv := quietServer(t, newMW(t, store, httpidem.Options{MaxResponseBytes: 1024}).Handler(h))
	r := do(t, nil, srv.URL, req{key: "big", body: "{}"})
	if r.status != http.StatusInternalServerError || r.problem(t).Type != problemResponseTooLarge {
		t.Fatalf("oversized response: %d", r.status)
	}
	if !errors.Is(writeErr, httpidem.ErrResponseTooLarge) {
		t.Fatalf("the handler's Write returned %v", writeErr)
	}
	// The effect may have happened: the key is not released, the 500 is
	// replayed and the handler never runs again.
	again := do(t, nil, srv.URL, req{key: "big", body: "{}"})
	if again.status != http.StatusInternalServerError || !again.replayed() || calls.Load() != 1 {
		t.Fatalf("retry: %d replayed=%v calls=%d", again.status, again.replayed(), calls.Load())
	}
}

// stampedStore is a lease store that records when, on its clock, its
// latest successful Extend began: the lease runs from that time or later.
type stampedStore struct {
	dedup.LeaseStore
	clock dedup.Clock
	mu    sync.Mutex
	from  time.Time
}

func (s *stampedStore) Extend(ctx context.Context, l *dedup.Lease) error {
	began := s.clock.Now()
	err := s.LeaseStore.Extend(ctx, l)
	if err == nil {
		s.mu.Lock()
		if began.After(s.from) {
			s.from = began
		}
		s.mu.Unlock()
	}
	return err
}

// extendedFrom is the clock's time when the latest successful Extend began.
func (s *stampedStore) extendedFrom() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.from
}

func TestLeaseIsExtendedWhileHandlerRuns(t *testing.T) {
	t.Parallel()
	clock := clocktest.NewManual(time.Unix(1_700_000_000, 0))
	mem := newMem(t, memstore.Options{Clock: clock, Lease: 30 * time.Second})
	store := &stampedStore{LeaseStore: mem, clock: clock}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// 5 × 20s of store time: far past the 30s lease, which survives
		// only because the middleware extends it. Each step waits for an
		// Extend that began at the current time (an Extend that began
		// before the last Advance, and returned after it, may have read
		// the old time: its lease would end before the next Advance).
		for range 5 {
			now := clock.Now()
			eventually(t, "an extension", func() bool { return !store.extendedFrom().Before(now) })
			clock.Advance(20 * time.Second)
		}
		w.WriteHeader(http.StatusCreated)
	})
	srv := quietServer(t, newMW(t, store, httpidem.Options{ExtendEvery: time.Millisecond}).Handler(h))
	if r := do(t, nil, srv.URL, req{key: "long", body: "{}"}); r.status != http.StatusCreated {
		t.Fatal(r.status)
	}
	if r := do(t, nil, srv.URL, req{key: "long", body: "{}"}); !r.replayed() {
		t.Fatal("the response of a long handler was not stored: its lease was lost")
	}
}

func TestLeaseLost(t *testing.T) {
	t.Parallel()
	clock := clocktest.NewManual(time.Unix(1_700_000_000, 0))
	store := newMem(t, memstore.Options{Clock: clock, Lease: 30 * time.Second})
	var calls atomic.Int64
	var cause error
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			clock.Advance(31 * time.Second) // the lease runs out
			<-r.Context().Done()            // the next beat finds it lost
			cause = context.Cause(r.Context())
		}
		w.WriteHeader(http.StatusCreated)
	})
	var outcome atomic.Value
	mw := newMW(t, store, httpidem.Options{ExtendEvery: time.Millisecond,
		Telemetry: consumer.Telemetry{
			OnOutcome: func(_ context.Context, rep consumer.Report) {
				outcome.Store(rep.Outcome)
			},
		}})
	srv := quietServer(t, mw.Handler(h))
	if r := do(t, nil, srv.URL, req{key: "lost", body: "{}"}); r.status != http.StatusCreated {
		t.Fatal(r.status)
	}
	if !errors.Is(cause, dedup.ErrLeaseLost) || outcome.Load() != consumer.OutcomeLeaseLost {
		t.Fatalf("cause %v, outcome %v", cause, outcome.Load())
	}
	// Not stored: the next request runs the handler (the lease expired).
	if r := do(t, nil, srv.URL, req{key: "lost", body: "{}"}); r.replayed() || calls.Load() != 2 {
		t.Fatalf("after a lost lease: replayed=%v calls=%d", r.replayed(), calls.Load())
	}
}

func TestStoreDownFailsClosed(t *testing.T) {
	t.Parallel()
	store, err := memstore.New(memstore.Options{SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	_ = store.Close()
	h := &countingHandler{}
	srv := quietServer(t, newMW(t, store, httpidem.Options{}).Handler(h))
	r := do(t, nil, srv.URL, req{key: "k", body: "{}"})
	if r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") != "1" || r.problem(t).Type != problemStoreUnavailable {
		t.Fatalf("store down: %d %v", r.status, r.header)
	}
	if h.calls.Load() != 0 {
		t.Fatal("the handler ran without a claim")
	}
}

func TestStoredResultUnreadable(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	mw := newMW(t, store, httpidem.Options{})
	r := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader("{}"))
	r.Header.Set("Idempotency-Key", "foreign")
	key, err := mw.Check(r)
	if err != nil {
		t.Fatal(err)
	}
	// Another program completed the key with a result of its own.
	lease, err := store.Claim(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Complete(context.Background(), lease, []byte("charged")); err != nil {
		t.Fatal(err)
	}
	h := &countingHandler{}
	resp := serveDirect(mw.Handler(h), httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader("{}")))
	if resp.status != http.StatusBadRequest { // no key on this one
		t.Fatal(resp.status)
	}
	r = httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader("{}"))
	r.Header.Set("Idempotency-Key", "foreign")
	resp = serveDirect(mw.Handler(h), r)
	if resp.status != http.StatusInternalServerError || resp.problem(t).Type != problemStoredUnreadable || h.calls.Load() != 0 {
		t.Fatalf("unreadable stored result: %d, calls %d", resp.status, h.calls.Load())
	}
}

func TestCheckOnItsOwn(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	mw := newMW(t, store, httpidem.Options{Principal: func(r *http.Request) string { return "acct_1" }})
	r := httptest.NewRequest(http.MethodPost, "/payments?x=1", strings.NewReader(`{"amount":1}`))
	r.Header.Set("Idempotency-Key", `"abc"`)
	key, err := mw.Check(r)
	if err != nil {
		t.Fatal(err)
	}
	if key.ID != "abc" || key.Scope != "http:6:acct_1:POST:/payments" || key.Fingerprint.IsZero() {
		t.Fatalf("key %+v", key)
	}
	if body, _ := io.ReadAll(r.Body); string(body) != `{"amount":1}` {
		t.Fatalf("body not restored: %q", body)
	}
	if rc, err := r.GetBody(); err != nil {
		t.Fatal(err)
	} else if body, _ := io.ReadAll(rc); string(body) != `{"amount":1}` {
		t.Fatalf("GetBody: %q", body)
	}
	if _, err := mw.Check(httptest.NewRequest(http.MethodGet, "/payments", nil)); !errors.Is(err, httpidem.ErrNoKey) {
		t.Fatalf("GET: %v", err)
	}
	_, err = mw.Check(httptest.NewRequest(http.MethodPost, "/payments", nil))
	var p *httpidem.Problem
	if !errors.As(err, &p) || p.Status != http.StatusBadRequest {
		t.Fatalf("no key: %v", err)
	}
	if store.Len() != 0 {
		t.Fatal("Check claimed something")
	}
}

func TestHandlerOutlivesClient(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	for _, cancelWithClient := range []bool{false, true} {
		entered, proceed := make(chan struct{}), make(chan struct{})
		var sawCancel atomic.Bool
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			close(entered)
			<-proceed
			sawCancel.Store(r.Context().Err() != nil)
			w.WriteHeader(http.StatusCreated)
		})
		mw := newMW(t, store, httpidem.Options{CancelWithClient: cancelWithClient})
		ctx, cancel := context.WithCancel(context.Background())
		r := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader("{}")).WithContext(ctx)
		r.Header.Set("Idempotency-Key", fmt.Sprint("gone-", cancelWithClient))
		done := make(chan response)
		go func() { done <- serveDirect(mw.Handler(h), r) }()
		<-entered
		cancel() // the client goes away while the handler runs
		close(proceed)
		resp := <-done
		if sawCancel.Load() != cancelWithClient {
			t.Fatalf("CancelWithClient=%v: the handler saw cancellation: %v", cancelWithClient, sawCancel.Load())
		}
		if resp.status != http.StatusCreated {
			t.Fatalf("status %d", resp.status)
		}
	}
}

func TestCustomReplayHeaders(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	h := &countingHandler{}
	srv := quietServer(t, newMW(t, store, httpidem.Options{ReplayHeaders: []string{"x-request-serial"}}).Handler(h))
	do(t, nil, srv.URL, req{key: "h", body: "{}"})
	r := do(t, nil, srv.URL, req{key: "h", body: "{}"})
	if r.header.Get("X-Request-Serial") != "1" || r.header.Get("Location") != "" {
		t.Fatalf("replayed headers %v", r.header)
	}
}

func TestOptionsValidation(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	for _, tc := range []struct {
		opts httpidem.Options
		want string
	}{
		{httpidem.Options{Wait: -1}, "Options.Wait"},
		{httpidem.Options{PollInterval: -1}, "Options.PollInterval"},
		{httpidem.Options{RetryAfter: -time.Second}, "Options.RetryAfter"},
		{httpidem.Options{FinishTimeout: -1}, "Options.FinishTimeout"},
		{httpidem.Options{MaxKeyLen: -1}, "Options.MaxKeyLen"},
		{httpidem.Options{MaxBodyBytes: -1}, "Options.MaxBodyBytes"},
		{httpidem.Options{MaxResponseBytes: -1}, "Options.MaxResponseBytes"},
		{httpidem.Options{Methods: []string{}}, "Options.Methods"},
		{httpidem.Options{Methods: []string{"PO ST"}}, "Options.Methods"},
		{httpidem.Options{ReplayHeaders: []string{"bad header"}}, "Options.ReplayHeaders"},
	} {
		_, err := httpidem.New(store, tc.opts)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v, want one naming %s", tc.opts, err, tc.want)
		}
	}
	if _, err := httpidem.New(nil, httpidem.Options{}); err == nil {
		t.Error("New(nil) succeeded")
	}
	if _, err := httpidem.NewTx[pgx.Tx](nil, httpidem.Options{}); err == nil {
		t.Error("NewTx(nil) succeeded")
	}
	m := newMW(t, store, httpidem.Options{})
	o := m.Options()
	if o.MaxKeyLen != 255 || o.MaxBodyBytes != 1<<20 || len(o.Methods) != 2 || o.RetryAfter != time.Second {
		t.Fatalf("defaults %+v", o)
	}
}
