package httpidem_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
)

// script is a server that answers attempt n with steps[n] (the last step
// repeats) and records each attempt's key and body.
type script struct {
	mu     sync.Mutex
	keys   []string
	bodies []string
	steps  []func(w http.ResponseWriter)
}

func (s *script) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	s.mu.Lock()
	n := len(s.keys)
	s.keys = append(s.keys, r.Header.Get("Idempotency-Key"))
	s.bodies = append(s.bodies, string(b))
	s.mu.Unlock()
	s.steps[min(n, len(s.steps)-1)](w)
}

func (s *script) attempts() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.keys...)
}

func status(code int, header ...string) func(w http.ResponseWriter) {
	return func(w http.ResponseWriter) {
		for i := 0; i+1 < len(header); i += 2 {
			w.Header().Set(header[i], header[i+1])
		}
		w.WriteHeader(code)
	}
}

func hangUp(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err == nil {
		_ = conn.Close()
	}
}

func fastTransport(t *testing.T, opts httpidem.TransportOptions) *httpidem.Transport {
	t.Helper()
	if opts.Backoff.Initial == 0 {
		opts.Backoff.Initial = time.Millisecond
	}
	if opts.Backoff.Max == 0 {
		opts.Backoff.Max = 5 * time.Millisecond
	}
	if opts.Base == nil {
		base := &http.Transport{}
		t.Cleanup(base.CloseIdleConnections)
		opts.Base = base
	}
	tr, err := httpidem.NewTransport(opts)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// answer is a response whose body was read and closed.
type answer struct {
	StatusCode int
	Header     http.Header
}

func roundTrip(ctx context.Context, t *testing.T, tr http.RoundTripper, method, url, body string) (*answer, error) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	rq, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := tr.RoundTrip(rq)
	if err != nil {
		return nil, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return &answer{StatusCode: resp.StatusCode, Header: resp.Header}, nil
}

func TestTransportRetriesWithOneKey(t *testing.T) {
	t.Parallel()
	s := &script{steps: []func(http.ResponseWriter){
		hangUp,
		status(http.StatusServiceUnavailable),
		status(http.StatusConflict, "Retry-After", "0"),
		status(http.StatusTooManyRequests),
		status(http.StatusBadGateway),
		status(http.StatusCreated),
	}}
	srv := quietServer(t, s)
	tr := fastTransport(t, httpidem.TransportOptions{MaxAttempts: 10})
	resp, err := roundTrip(context.Background(), t, tr, http.MethodPost, srv.URL, `{"amount":1}`)
	if err != nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("%v %v", resp, err)
	}
	keys := s.attempts()
	if len(keys) != 6 {
		t.Fatalf("%d attempts, want 6", len(keys))
	}
	for i, k := range keys {
		if k != keys[0] {
			t.Fatalf("attempt %d sent key %q, the first sent %q", i, k, keys[0])
		}
	}
	id, err := httpidem.ParseKey(keys[0], 0)
	if err != nil || !strings.HasPrefix(keys[0], `"`) || len(id) != 36 {
		t.Fatalf("generated key %q (%v): want a quoted UUID", keys[0], err)
	}
	for _, b := range s.bodies {
		if b != `{"amount":1}` {
			t.Fatalf("a retry sent body %q", b)
		}
	}
	// The next operation gets a new key.
	s2 := &script{steps: []func(http.ResponseWriter){status(http.StatusCreated)}}
	srv2 := quietServer(t, s2)
	if _, err := roundTrip(context.Background(), t, tr, http.MethodPost, srv2.URL, "{}"); err != nil {
		t.Fatal(err)
	}
	if s2.attempts()[0] == keys[0] {
		t.Fatal("two operations shared a key")
	}
}

func TestTransportKeySources(t *testing.T) {
	t.Parallel()
	s := &script{steps: []func(http.ResponseWriter){status(http.StatusServiceUnavailable), status(http.StatusOK)}}
	srv := quietServer(t, s)
	tr := fastTransport(t, httpidem.TransportOptions{BareKey: true})

	// The context's key: one operation over several RoundTrip calls.
	ctx := httpidem.WithKey(context.Background(), "order-42-payment")
	if _, err := roundTrip(ctx, t, tr, http.MethodPost, srv.URL, "{}"); err != nil {
		t.Fatal(err)
	}
	// The request's own header wins and is sent as it is.
	rq, _ := http.NewRequest(http.MethodPatch, srv.URL, strings.NewReader("{}"))
	rq.Header.Set("Idempotency-Key", `"mine"`)
	resp, err := tr.RoundTrip(rq)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	got := s.attempts()
	want := []string{"order-42-payment", "order-42-payment", `"mine"`}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("keys %q, want %q", got, want)
	}
	if k, ok := httpidem.KeyFrom(ctx); !ok || k != "order-42-payment" {
		t.Fatal("KeyFrom")
	}
}

func TestTransportDoesNotRetry(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		method string
		step   func(http.ResponseWriter)
		want   int
	}{
		{"a replayed 500 is final", http.MethodPost, status(http.StatusInternalServerError, "Idempotent-Replayed", "true"), http.StatusInternalServerError},
		{"400", http.MethodPost, status(http.StatusBadRequest), http.StatusBadRequest},
		{"422", http.MethodPost, status(http.StatusUnprocessableEntity), http.StatusUnprocessableEntity},
		{"501", http.MethodPost, status(http.StatusNotImplemented), http.StatusNotImplemented},
		{"a method with no key and no idempotence", "LOCK", status(http.StatusServiceUnavailable), http.StatusServiceUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := &script{steps: []func(http.ResponseWriter){tc.step, status(http.StatusOK)}}
			srv := quietServer(t, s)
			resp, err := roundTrip(context.Background(), t, fastTransport(t, httpidem.TransportOptions{}), tc.method, srv.URL, "{}")
			if err != nil || resp.StatusCode != tc.want || len(s.attempts()) != 1 {
				t.Fatalf("status %v, err %v, %d attempts", resp, err, len(s.attempts()))
			}
		})
	}
}

func TestTransportBounds(t *testing.T) {
	t.Parallel()
	s := &script{steps: []func(http.ResponseWriter){status(http.StatusServiceUnavailable)}}
	srv := quietServer(t, s)
	// MaxAttempts: the last answer is returned.
	resp, err := roundTrip(context.Background(), t, fastTransport(t, httpidem.TransportOptions{MaxAttempts: 3}), http.MethodPost, srv.URL, "{}")
	if err != nil || resp.StatusCode != http.StatusServiceUnavailable || len(s.attempts()) != 3 {
		t.Fatalf("%v %v, %d attempts", resp, err, len(s.attempts()))
	}
	// A Retry-After beyond MaxElapsed is not waited for.
	s2 := &script{steps: []func(http.ResponseWriter){status(http.StatusTooManyRequests, "Retry-After", "3600")}}
	srv2 := quietServer(t, s2)
	resp, err = roundTrip(context.Background(), t, fastTransport(t, httpidem.TransportOptions{MaxElapsed: time.Second}), http.MethodPost, srv2.URL, "{}")
	if err != nil || resp.StatusCode != http.StatusTooManyRequests || len(s2.attempts()) != 1 {
		t.Fatalf("%v %v, %d attempts", resp, err, len(s2.attempts()))
	}
	// The context ends the wait. The cancel comes from the first answer's
	// body, which the Transport drains and closes once it has chosen to
	// retry and before it waits the 30s Retry-After: it lands during the
	// wait, never before the Transport looked at the answer. A wait that
	// ignored the context would send a second attempt, or return only
	// after the 30s.
	s3 := &script{steps: []func(http.ResponseWriter){status(http.StatusServiceUnavailable, "Retry-After", "30")}}
	srv3 := quietServer(t, s3)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	base3 := &http.Transport{}
	t.Cleanup(base3.CloseIdleConnections)
	var sent atomic.Int64
	cancelOnClose := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		sent.Add(1)
		resp, err := base3.RoundTrip(r)
		if err == nil {
			resp.Body = &closeHook{ReadCloser: resp.Body, onClose: cancel}
		}
		return resp, err
	})
	tr3 := fastTransport(t, httpidem.TransportOptions{Base: cancelOnClose, MaxElapsed: time.Minute})
	start := time.Now()
	_, err = roundTrip(ctx, t, tr3, http.MethodPost, srv3.URL, "{}")
	if took := time.Since(start); !errors.Is(err, context.Canceled) || sent.Load() != 1 || took >= 30*time.Second {
		t.Fatalf("cancelled during the backoff: %v after %d attempts and %v", err, sent.Load(), took)
	}
	// Retries run out on network errors too.
	s4 := &script{steps: []func(http.ResponseWriter){hangUp}}
	srv4 := quietServer(t, s4)
	if _, err := roundTrip(context.Background(), t, fastTransport(t, httpidem.TransportOptions{MaxAttempts: 4}), http.MethodPost, srv4.URL, "{}"); err == nil || len(s4.attempts()) != 4 {
		t.Fatalf("hang-ups: %v after %d attempts", err, len(s4.attempts()))
	}
}

// roundTripFunc adapts a function to http.RoundTripper.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// closeHook is a body that calls onClose when it is closed.
type closeHook struct {
	io.ReadCloser
	onClose func()
}

func (c *closeHook) Close() error {
	c.onClose()
	return c.ReadCloser.Close()
}

func TestTransportNeedsReplayableBody(t *testing.T) {
	t.Parallel()
	s := &script{steps: []func(http.ResponseWriter){status(http.StatusOK)}}
	srv := quietServer(t, s)
	rq, _ := http.NewRequest(http.MethodPost, srv.URL, io.NopCloser(strings.NewReader("{}")))
	rq.GetBody = nil
	resp, err := fastTransport(t, httpidem.TransportOptions{}).RoundTrip(rq)
	if resp != nil {
		_ = resp.Body.Close()
	}
	if err == nil || !strings.Contains(err.Error(), "GetBody") || len(s.attempts()) != 0 {
		t.Fatalf("%v", err)
	}
}

func TestTransportOptionsValidation(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		opts httpidem.TransportOptions
		want string
	}{
		{httpidem.TransportOptions{MaxAttempts: -1}, "MaxAttempts"},
		{httpidem.TransportOptions{MaxElapsed: -1}, "MaxElapsed"},
		{httpidem.TransportOptions{Backoff: consumer.Backoff{Initial: -1}}, "Backoff: Initial"},
		{httpidem.TransportOptions{Backoff: consumer.Backoff{Factor: 0.5}}, "Backoff: Factor"},
		{httpidem.TransportOptions{Backoff: consumer.Backoff{Initial: time.Second, Max: time.Millisecond}}, "Backoff: Initial (1s) is greater than Max"},
		{httpidem.TransportOptions{Methods: []string{"a b"}}, "Methods"},
	} {
		if _, err := httpidem.NewTransport(tc.opts); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v", tc.want, err)
		}
	}
}

// The client and the middleware together: the server is busy with the
// first attempt (409 with Retry-After), the client waits and gets the
// replay; the handler ran once.
func TestTransportAgainstMiddleware(t *testing.T) {
	t.Parallel()
	store := &hookStore{LeaseStore: newMem(t, memstore.Options{})}
	conflict := make(chan struct{}, 10)
	store.onClaim = func(err error) {
		if errors.Is(err, dedup.ErrInFlight) {
			conflict <- struct{}{}
		}
	}
	entered, unblock := make(chan struct{}), make(chan struct{})
	var once sync.Once
	h := &countingHandler{}
	mw := newMW(t, store, httpidem.Options{})
	srv := quietServer(t, mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		once.Do(func() { close(entered); <-unblock })
		h.ServeHTTP(w, r)
	})))
	ctx := httpidem.WithKey(context.Background(), "op-1")
	first := make(chan error)
	go func() {
		_, err := roundTrip(ctx, t, fastTransport(t, httpidem.TransportOptions{}), http.MethodPost, srv.URL, "{}")
		first <- err
	}()
	<-entered
	second := make(chan *answer)
	go func() {
		resp, _ := roundTrip(ctx, t, fastTransport(t, httpidem.TransportOptions{}), http.MethodPost, srv.URL, "{}")
		second <- resp
	}()
	<-conflict // the second attempt was answered 409
	close(unblock)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	resp := <-second
	if resp == nil || resp.StatusCode != http.StatusCreated || h.calls.Load() != 1 {
		t.Fatalf("second: %v, calls %d", resp, h.calls.Load())
	}
}
