package httpidem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/testenv"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
)

func newMem(t testing.TB, opts memstore.Options) *memstore.Store {
	t.Helper()
	if opts.SweepInterval == 0 {
		opts.SweepInterval = -1
	}
	s, err := memstore.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func newMW(t testing.TB, store dedup.LeaseStore, opts httpidem.Options) *httpidem.Middleware {
	t.Helper()
	m, err := httpidem.New(store, opts)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// quietServer is an httptest server whose panics and errors are not logged
// (tests make handlers panic on purpose).
func quietServer(t testing.TB, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewUnstartedServer(h)
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.Start()
	t.Cleanup(srv.Close)
	return srv
}

// response is a response read in full.
type response struct {
	status int
	header http.Header
	body   []byte
}

func (r response) replayed() bool { return r.header.Get("Idempotent-Replayed") == "true" }

func (r response) problem(t testing.TB) httpidem.Problem {
	t.Helper()
	if ct := r.header.Get("Content-Type"); ct != httpidem.ContentTypeProblem {
		t.Fatalf("status %d, Content-Type %q, want %s; body %s", r.status, ct, httpidem.ContentTypeProblem, r.body)
	}
	var p httpidem.Problem
	if err := json.Unmarshal(r.body, &p); err != nil {
		t.Fatalf("problem body %q: %v", r.body, err)
	}
	if p.Status != r.status {
		t.Fatalf("problem status %d, response status %d", p.Status, r.status)
	}
	return p
}

type req struct {
	method string
	path   string
	key    string // "" sends no header
	body   string
	header map[string]string
}

func do(t testing.TB, c *http.Client, base string, rq req) response {
	t.Helper()
	resp, err := send(context.Background(), c, base, rq)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func send(ctx context.Context, c *http.Client, base string, rq req) (response, error) {
	method := rq.method
	if method == "" {
		method = http.MethodPost
	}
	path := rq.path
	if path == "" {
		path = "/payments"
	}
	r, err := http.NewRequestWithContext(ctx, method, base+path, bytes.NewReader([]byte(rq.body)))
	if err != nil {
		return response{}, err
	}
	if rq.key != "" {
		r.Header.Set("Idempotency-Key", rq.key)
	}
	for k, v := range rq.header {
		r.Header.Set(k, v)
	}
	if c == nil {
		c = http.DefaultClient
	}
	resp, err := c.Do(r)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return response{}, err
	}
	return response{status: resp.StatusCode, header: resp.Header, body: body}, nil
}

// serveDirect runs h on a request without a server (ServeHTTP), for
// requests a client would refuse to send.
func serveDirect(h http.Handler, r *http.Request) response {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, r)
	return response{status: rec.Code, header: rec.Result().Header, body: rec.Body.Bytes()}
}

// countingHandler answers 201 with a JSON receipt numbered by call, a
// Location and a header that must not be replayed.
type countingHandler struct {
	calls atomic.Int64
}

func (h *countingHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := h.calls.Add(1)
	body, _ := io.ReadAll(r.Body)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/payments/p"+itoa(n))
	w.Header().Set("X-Request-Serial", itoa(n))
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(map[string]any{"receipt": "r" + itoa(n), "echo": string(body)})
}

func itoa(n int64) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// hookStore wraps a LeaseStore and reports its calls.
type hookStore struct {
	dedup.LeaseStore
	mu      sync.Mutex
	onClaim func(error)
	// beforeClaim, when set, runs before each Claim with its context.
	beforeClaim func(context.Context)
	extends     atomic.Int64
	releases    atomic.Int64
}

func (s *hookStore) Claim(ctx context.Context, k dedup.Key) (*dedup.Lease, error) {
	s.mu.Lock()
	before := s.beforeClaim
	s.mu.Unlock()
	if before != nil {
		before(ctx)
	}
	l, err := s.LeaseStore.Claim(ctx, k)
	s.mu.Lock()
	f := s.onClaim
	s.mu.Unlock()
	if f != nil {
		f(err)
	}
	return l, err
}

func (s *hookStore) Extend(ctx context.Context, l *dedup.Lease) error {
	err := s.LeaseStore.Extend(ctx, l)
	if err == nil {
		s.extends.Add(1)
	}
	return err
}

func (s *hookStore) Release(ctx context.Context, l *dedup.Lease) error {
	s.releases.Add(1)
	return s.LeaseStore.Release(ctx, l)
}

// hookTx wraps a transactional store and calls before ahead of each Process.
type hookTx struct {
	dedup.TxStore[pgx.Tx]
	before func(context.Context)
}

func (s hookTx) Process(ctx context.Context, k dedup.Key, fn dedup.TxFunc[pgx.Tx]) ([]byte, error) {
	s.before(ctx)
	return s.TxStore.Process(ctx, k, fn)
}

// eventually polls cond until it holds or a generous deadline passes (a
// bound against hangs, not a timing assertion).
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	testenv.Eventually(t, 20*time.Second, what, cond)
}

// The problem types (RFC 9457 "type") the middleware writes: stable tag
// URIs a client compares against.
const (
	problemKeyMissing       = "tag:idemkit,2026:http/idempotency-key-missing"
	problemKeyInvalid       = "tag:idemkit,2026:http/idempotency-key-invalid"
	problemBodyTooLarge     = "tag:idemkit,2026:http/body-too-large"
	problemKeyReused        = "tag:idemkit,2026:http/idempotency-key-reused"
	problemInProgress       = "tag:idemkit,2026:http/request-in-progress"
	problemStoreUnavailable = "tag:idemkit,2026:http/store-unavailable"
	problemResponseTooLarge = "tag:idemkit,2026:http/response-too-large"
	problemStoredUnreadable = "tag:idemkit,2026:http/stored-response-unreadable"
	problemEventIDMissing   = "tag:idemkit,2026:http/webhook-event-id-missing"
)

// The webhook handler's default headers.
const (
	defaultSignatureHeader = "Webhook-Signature"
	defaultEventIDHeader   = "Webhook-Id"
)
