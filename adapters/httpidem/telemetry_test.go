package httpidem_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// principal is the tenant of the telemetry tests' requests: part of every
// key's scope, and in no metric, span or log.
const principal = "tenant-secret-42"

const route = "POST /payments"

// telKind is a store for the telemetry tests: a middleware on it and a
// lease store on the same keys, to hold a key in flight.
type telKind struct {
	name  string
	setup func(t *testing.T, opts httpidem.Options) (*httpidem.Middleware, dedup.LeaseStore)
}

var telKinds = []telKind{
	{"memstore", func(t *testing.T, opts httpidem.Options) (*httpidem.Middleware, dedup.LeaseStore) {
		s := newMem(t, memstore.Options{})
		return newMW(t, s, opts), s
	}},
	{"pgtable", func(t *testing.T, opts httpidem.Options) (*httpidem.Middleware, dedup.LeaseStore) {
		pool := testenv.Pool(t, 5)
		s := pgStore(t, pool, testenv.Schema(t, pool))
		return mustMW(t)(httpidem.NewTx(s, opts)), s.Lease()
	}},
}

// telHandler answers 201, or releases the key and answers 400 when the body
// says so, or blocks until unblock is closed when it says "slow".
func telHandler(entered chan<- struct{}, unblock <-chan struct{}) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var b bytes.Buffer
		_, _ = b.ReadFrom(r.Body)
		switch {
		case strings.Contains(b.String(), "release"):
			httpidem.Release(r.Context())
			http.Error(w, "invalid amount", http.StatusBadRequest)
			return
		case strings.Contains(b.String(), "slow"):
			entered <- struct{}{}
			<-unblock
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"receipt":"r1"}`))
	})
}

// routed serves h on the route behind a ServeMux, as in an application.
func routed(t *testing.T, h http.Handler) *httptest.Server {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle(route, h)
	return quietServer(t, mux)
}

func asTenant(rq req) req {
	rq.header = map[string]string{"X-User": principal}
	return rq
}

func byTenant(r *http.Request) string { return r.Header.Get("X-User") }

// keyOf returns the dedup key the middleware builds for rq.
func keyOf(t *testing.T, mw *httpidem.Middleware, rq req) dedup.Key {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(rq.body))
	r.Pattern = route
	r.Header.Set("Idempotency-Key", rq.key)
	for k, v := range rq.header {
		r.Header.Set(k, v)
	}
	k, err := mw.Check(r)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// TestMetricsByOutcome: each way a request ends increments its claim
// outcome and message result, with the route pattern as idem.scope and
// never the principal or a key.
func TestMetricsByOutcome(t *testing.T) {
	t.Parallel()
	for _, k := range telKinds {
		t.Run(k.name, func(t *testing.T) {
			mp := telemetrytest.NewMetrics(t)
			mw, hold := k.setup(t, httpidem.Options{Principal: byTenant, MaxBodyBytes: 256, Telemetry: consumer.Telemetry{MeterProvider: mp}})
			srv := routed(t, mw.Handler(telHandler(nil, nil)))

			held := asTenant(req{key: "key-held", body: `{"amount":3}`})
			lease, err := hold.Claim(context.Background(), keyOf(t, mw, held))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = hold.Release(context.Background(), lease) })
			for _, c := range []struct {
				rq     req
				status int
			}{
				{asTenant(req{key: "key-one", body: `{"amount":1}`}), http.StatusCreated},             // first, completed: ack
				{asTenant(req{key: "key-one", body: `{"amount":1}`}), http.StatusCreated},             // duplicate (replay): ack
				{asTenant(req{key: "key-one", body: `{"amount":2}`}), http.StatusUnprocessableEntity}, // mismatch: dead letter
				{asTenant(req{body: `{"amount":1}`}), http.StatusBadRequest},                          // no key: dead letter
				{asTenant(req{key: "key bad,", body: `{"amount":1}`}), http.StatusBadRequest},         // invalid key: dead letter
				{asTenant(req{key: "key-release", body: `{"release":true}`}), http.StatusBadRequest},  // first, released: retry
				{held, http.StatusConflict}, // in flight: retry
				{asTenant(req{key: "key-big", body: strings.Repeat("x", 1000)}), http.StatusRequestEntityTooLarge}, // dead letter
			} {
				if r := do(t, nil, srv.URL, c.rq); r.status != c.status {
					t.Fatalf("%q: status %d, want %d: %s", c.rq.key, r.status, c.status, r.body)
				}
			}

			scope := telemetry.AttrScope.String(route)
			store := telemetry.AttrStore.String(k.name)
			for _, c := range []struct {
				outcome string
				want    float64
			}{
				{telemetry.ClaimFirst, 2},
				{telemetry.ClaimDuplicate, 1},
				{telemetry.ClaimFingerprintMismatch, 1},
				{telemetry.ClaimInvalidKey, 2},
				{telemetry.ClaimInFlight, 1},
				{telemetry.ClaimError, 0},
			} {
				o := telemetry.AttrOutcome.String(c.outcome)
				if got := mp.Sum(telemetry.MetricClaims, scope, store, o); got != c.want {
					t.Errorf("%s{outcome=%s} = %v, want %v", telemetry.MetricClaims, c.outcome, got, c.want)
				}
			}
			for outcome, want := range map[string]float64{"completed": 1, "released": 1} {
				if got := mp.Sum(telemetry.MetricHandlerDuration, scope, store, telemetry.AttrOutcome.String(outcome)); got != want {
					t.Errorf("%s{outcome=%s} = %v, want %v", telemetry.MetricHandlerDuration, outcome, got, want)
				}
			}
			httpAttrs := []attribute.KeyValue{telemetry.AttrSystem.String("http"), telemetry.AttrDestination.String(route)}
			for _, c := range []struct {
				result, reason string
				want           float64
			}{
				{"ack", "", 2},
				{"retry", "", 2},
				{"dead_letter", "fingerprint_mismatch", 1},
				{"dead_letter", "invalid_key", 2},
				{"dead_letter", "body_too_large", 1},
			} {
				attrs := append(slices.Clone(httpAttrs), telemetry.AttrResult.String(c.result))
				if c.reason != "" {
					attrs = append(attrs, telemetry.AttrReason.String(c.reason))
				}
				if got := mp.Sum(telemetry.MetricMessages, attrs...); got != c.want {
					t.Errorf("%s{result=%s,reason=%s} = %v, want %v", telemetry.MetricMessages, c.result, c.reason, got, c.want)
				}
			}
			if got := mp.Sum(telemetry.MetricProcessDuration, httpAttrs...); got != 8 {
				t.Errorf("%s count = %v, want 8 requests", telemetry.MetricProcessDuration, got)
			}
			mp.NoValueContains(principal, "key-", "/payments/")
		})
	}
}

// TestMetricsStoreDown: a store that fails is a claim error and a retry.
func TestMetricsStoreDown(t *testing.T) {
	t.Parallel()
	mp := telemetrytest.NewMetrics(t)
	store := newMem(t, memstore.Options{})
	_ = store.Close()
	mw := newMW(t, store, httpidem.Options{StoreName: "down", Telemetry: consumer.Telemetry{MeterProvider: mp}})
	srv := routed(t, mw.Handler(telHandler(nil, nil)))
	if r := do(t, nil, srv.URL, req{key: "key-1", body: "{}"}); r.status != http.StatusServiceUnavailable {
		t.Fatalf("store down: %d", r.status)
	}
	if got := mp.Sum(telemetry.MetricClaims, telemetry.AttrStore.String("down"), telemetry.AttrOutcome.String(telemetry.ClaimError)); got != 1 {
		t.Errorf("claims{error} = %v, want 1", got)
	}
	if got := mp.Sum(telemetry.MetricMessages, telemetry.AttrResult.String("retry")); got != 1 {
		t.Errorf("messages{retry} = %v, want 1", got)
	}
}

// TestMetricsScopeWithoutMux: without a ServeMux pattern the scope is the
// method, never the path (which holds ids); MetricScope overrides it.
func TestMetricsScopeWithoutMux(t *testing.T) {
	t.Parallel()
	mp := telemetrytest.NewMetrics(t)
	plain := newMW(t, newMem(t, memstore.Options{}), httpidem.Options{Telemetry: consumer.Telemetry{MeterProvider: mp}})
	named := newMW(t, newMem(t, memstore.Options{}), httpidem.Options{
		MetricScope: func(*http.Request) string { return "refunds" },
		Telemetry: consumer.Telemetry{
			MeterProvider: mp,
		}})
	for _, mw := range []*httpidem.Middleware{plain, named} {
		srv := quietServer(t, mw.Handler(telHandler(nil, nil)))
		do(t, nil, srv.URL, req{path: "/payments/pay-8812/refunds", key: "key-1", body: "{}"})
	}
	for _, scope := range []string{http.MethodPost, "refunds"} {
		if got := mp.Sum(telemetry.MetricClaims, telemetry.AttrScope.String(scope), telemetry.AttrOutcome.String("first")); got != 1 {
			t.Errorf("claims{scope=%s} = %v, want 1", scope, got)
		}
	}
	mp.NoValueContains("pay-8812")
}

// TestMetricsWebhook: a webhook's scope is its configured one; a bad
// signature is a dead letter without a claim.
func TestMetricsWebhook(t *testing.T) {
	t.Parallel()
	mp := telemetrytest.NewMetrics(t)
	secret := []byte("whsec_test")
	wh, err := httpidem.NewWebhook(newMem(t, memstore.Options{}), httpidem.WebhookOptions{
		Secrets: [][]byte{secret}, Scope: "stripe", Options: httpidem.Options{Telemetry: consumer.Telemetry{MeterProvider: mp}}})
	if err != nil {
		t.Fatal(err)
	}
	srv := quietServer(t, wh.Handler(telHandler(nil, nil)))
	body := `{"id":"evt_1"}`
	good := req{key: "", body: body, header: map[string]string{
		defaultEventIDHeader:   "evt_1",
		defaultSignatureHeader: httpidem.SignWebhook(secret, time.Now(), []byte(body)),
	}}
	forged := req{body: body, header: map[string]string{
		defaultEventIDHeader:   "evt_1",
		defaultSignatureHeader: httpidem.SignWebhook([]byte("other"), time.Now(), []byte(body)),
	}}
	for _, rq := range []req{forged, good, good} {
		do(t, nil, srv.URL, rq)
	}
	scope := telemetry.AttrScope.String("stripe")
	for o, want := range map[string]float64{"first": 1, "duplicate": 1} {
		if got := mp.Sum(telemetry.MetricClaims, scope, telemetry.AttrOutcome.String(o)); got != want {
			t.Errorf("claims{%s} = %v, want %v", o, got, want)
		}
	}
	if got := mp.Sum(telemetry.MetricMessages, telemetry.AttrDestination.String("stripe"), telemetry.AttrReason.String("signature_invalid")); got != 1 {
		t.Errorf("messages{dead_letter, signature_invalid} = %v, want 1", got)
	}
	mp.NoValueContains("evt_")
}

// TestMetricsLeaseWaitEndsDuringClaim: the request's context ends while a
// claim retried during Options.Wait runs, not during the pause between two
// claims: the client goes away, or a deadline an outer handler set passes.
// The wait is cancelled and the last answer (in flight) stands; the
// store's context error is not counted as a store failure.
func TestMetricsLeaseWaitEndsDuringClaim(t *testing.T) {
	t.Parallel()
	opts := httpidem.Options{Principal: byTenant, Wait: time.Minute, PollInterval: time.Millisecond}
	gone := asTenant(req{key: "key-gone", body: `{}`})
	// holdRetry runs before every claim (Claim or Process): the first
	// retry signals retrying and waits until the request's context ended.
	var claims atomic.Int32
	retrying := make(chan struct{})
	holdRetry := func(ctx context.Context) {
		if claims.Add(1) == 2 {
			close(retrying)
			<-ctx.Done()
		}
	}
	kinds := []struct {
		name  string
		setup func(t *testing.T, opts httpidem.Options) (*httpidem.Middleware, dedup.LeaseStore)
	}{
		{"memstore", func(t *testing.T, opts httpidem.Options) (*httpidem.Middleware, dedup.LeaseStore) {
			mem := newMem(t, memstore.Options{})
			return newMW(t, &hookStore{LeaseStore: mem, beforeClaim: holdRetry}, opts), mem
		}},
		{"pgtable", func(t *testing.T, opts httpidem.Options) (*httpidem.Middleware, dedup.LeaseStore) {
			pool := testenv.Pool(t, 5)
			s := pgStore(t, pool, testenv.Schema(t, pool))
			return mustMW(t)(httpidem.NewTx(hookTx{TxStore: s, before: holdRetry}, opts)), s.Lease()
		}},
	}
	for _, kind := range kinds {
		for _, deadline := range []bool{false, true} {
			name := kind.name + "/client_leaves"
			if deadline {
				name = kind.name + "/deadline"
			}
			t.Run(name, func(t *testing.T) {
				claims.Store(0)
				retrying = make(chan struct{})
				mp := telemetrytest.NewMetrics(t)
				o := opts
				o.MeterProvider = mp
				mw, holder := kind.setup(t, o)
				h := mw.Handler(telHandler(nil, nil))
				if deadline {
					// The deadline passes while the retry is held (the
					// first claim comes well before it).
					inner := h
					h = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
						ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
						defer cancel()
						inner.ServeHTTP(w, r.WithContext(ctx))
					})
				}
				srv := routed(t, h)
				if _, err := holder.Claim(context.Background(), keyOf(t, mw, gone)); err != nil {
					t.Fatal(err)
				}
				if deadline {
					if r, err := send(context.Background(), nil, srv.URL, gone); err != nil || r.status != http.StatusConflict {
						t.Fatalf("deadline during the wait: %v, %v; want 409", r.status, err)
					}
				} else {
					ctx, cancel := context.WithCancel(context.Background())
					go func() { <-retrying; cancel() }()
					if _, err := send(ctx, nil, srv.URL, gone); !errors.Is(err, context.Canceled) {
						t.Fatalf("cancelled wait: %v", err)
					}
				}
				eventually(t, "the wait's metrics", func() bool {
					return mp.Sum(telemetry.MetricLeaseWait) == 1
				})
				scope := telemetry.AttrScope.String(route)
				for o, want := range map[string]float64{"cancelled": 1, "error": 0} {
					if got := mp.Sum(telemetry.MetricLeaseWait, scope, telemetry.AttrWaitOutcome.String(o)); got != want {
						t.Errorf("%s{%s} = %v, want %v", telemetry.MetricLeaseWait, o, got, want)
					}
				}
				for o, want := range map[string]float64{"in_flight": 1, "error": 0} {
					if got := mp.Sum(telemetry.MetricClaims, scope, telemetry.AttrOutcome.String(o)); got != want {
						t.Errorf("claims{%s} = %v, want %v", o, got, want)
					}
				}
			})
		}
	}
}

// TestMetricsLeaseWait: Options.Wait's waits are recorded by how they
// ended: replayed (the first finished), acquired (it released the key),
// timed out (409) and cancelled (the client left).
func TestMetricsLeaseWait(t *testing.T) {
	t.Parallel()
	mp := telemetrytest.NewMetrics(t)
	mem := newMem(t, memstore.Options{})
	store := &hookStore{LeaseStore: mem}
	inFlight := make(chan struct{}, 1000)
	store.onClaim = func(err error) {
		if errors.Is(err, dedup.ErrInFlight) {
			select {
			case inFlight <- struct{}{}:
			default:
			}
		}
	}
	drain := func() {
		for {
			select {
			case <-inFlight:
			default:
				return
			}
		}
	}
	entered, unblock := make(chan struct{}, 1), make(chan struct{})
	long := newMW(t, store, httpidem.Options{Principal: byTenant, Wait: time.Minute, PollInterval: time.Millisecond, Telemetry: consumer.Telemetry{MeterProvider: mp}})
	srv := routed(t, long.Handler(telHandler(entered, unblock)))

	// Replayed: the second request waits for the slow first one.
	slow := asTenant(req{key: "key-slow", body: `"slow"`})
	first := make(chan response)
	go func() { r, _ := send(context.Background(), nil, srv.URL, slow); first <- r }()
	<-entered
	second := make(chan response)
	go func() { r, _ := send(context.Background(), nil, srv.URL, slow); second <- r }()
	<-inFlight
	close(unblock)
	if a, b := <-first, <-second; a.status != http.StatusCreated || !b.replayed() {
		t.Fatalf("first %d, second replayed=%v", a.status, b.replayed())
	}

	// Acquired: the key's other owner releases it while the request waits.
	drain()
	held := asTenant(req{key: "key-held", body: `{}`})
	lease, err := mem.Claim(context.Background(), keyOf(t, long, held))
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		<-inFlight
		_ = mem.Release(context.Background(), lease)
	}()
	if r := do(t, nil, srv.URL, held); r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("acquired: %d replayed=%v", r.status, r.replayed())
	}

	// Cancelled: the client gives up while the request waits.
	drain()
	stuck := asTenant(req{key: "key-stuck", body: `{}`})
	if _, err := mem.Claim(context.Background(), keyOf(t, long, stuck)); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-inFlight; cancel() }()
	if _, err := send(ctx, nil, srv.URL, stuck); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled wait: %v", err)
	}

	// Timed out: Options.Wait runs out.
	short := newMW(t, store, httpidem.Options{Principal: byTenant, Wait: 20 * time.Millisecond, PollInterval: time.Millisecond, Telemetry: consumer.Telemetry{MeterProvider: mp}})
	srv2 := routed(t, short.Handler(telHandler(nil, nil)))
	if r := do(t, nil, srv2.URL, stuck); r.status != http.StatusConflict {
		t.Fatalf("timed out wait: %d", r.status)
	}

	eventually(t, "the cancelled request's metrics", func() bool {
		return mp.Sum(telemetry.MetricLeaseWait, telemetry.AttrWaitOutcome.String("cancelled")) == 1
	})
	scope := telemetry.AttrScope.String(route)
	for o, want := range map[string]float64{"replayed": 1, "acquired": 1, "cancelled": 1, "timed_out": 1, "error": 0} {
		if got := mp.Sum(telemetry.MetricLeaseWait, scope, telemetry.AttrWaitOutcome.String(o)); got != want {
			t.Errorf("%s{%s} = %v, want %v", telemetry.MetricLeaseWait, o, got, want)
		}
	}
	// One claim per request, by its final answer.
	for o, want := range map[string]float64{"first": 2, "duplicate": 1, "in_flight": 2} {
		if got := mp.Sum(telemetry.MetricClaims, scope, telemetry.AttrOutcome.String(o)); got != want {
			t.Errorf("claims{%s} = %v, want %v", o, got, want)
		}
	}
	mp.NoValueContains(principal, "key-")
}

// TestSpansUnderRequestSpan: under a recording request span the idem
// spans are its children and the handler runs under idem.handle; without
// one there are no spans. No span holds the key or the principal.
func TestSpansUnderRequestSpan(t *testing.T) {
	t.Parallel()
	for _, k := range telKinds {
		t.Run(k.name, func(t *testing.T) {
			tp := telemetrytest.NewSpans(t)
			mw, _ := k.setup(t, httpidem.Options{Principal: byTenant, Telemetry: consumer.Telemetry{TracerProvider: tp}})
			var handlerSpan trace.SpanContext
			h := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				handlerSpan = trace.SpanContextFromContext(r.Context())
				w.WriteHeader(http.StatusCreated)
			}))
			var serverSpan trace.SpanContext
			var traced atomic.Bool
			srv := routed(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if !traced.Load() {
					h.ServeHTTP(w, r)
					return
				}
				// What otelhttp does: a server span around the handler.
				ctx, span := tp.Tracer("otelhttp").Start(r.Context(), route, trace.WithSpanKind(trace.SpanKindServer))
				defer span.End()
				serverSpan = span.SpanContext()
				h.ServeHTTP(w, r.WithContext(ctx))
			}))

			do(t, nil, srv.URL, asTenant(req{key: "key-untraced", body: "{}"}))
			if n := len(tp.Ended()); n != 0 {
				t.Fatalf("%d spans without a request span, want 0", n)
			}
			traced.Store(true)
			rq := asTenant(req{key: "key-traced", body: "{}"})
			if r := do(t, nil, srv.URL, rq); r.status != http.StatusCreated {
				t.Fatal(r.status)
			}
			finish := "idem.complete"
			if k.name == "pgtable" {
				finish = "idem.commit"
			}
			for _, name := range []string{"idem.claim", "idem.handle", finish} {
				spans := tp.Named(name)
				if len(spans) != 1 {
					t.Fatalf("%d %s spans, want 1", len(spans), name)
				}
				if spans[0].Parent().SpanID() != serverSpan.SpanID() {
					t.Errorf("%s's parent is %v, want the request span", name, spans[0].Parent().SpanID())
				}
			}
			if handlerSpan.SpanID() != tp.Named("idem.handle")[0].SpanContext().SpanID() {
				t.Error("the handler does not run under idem.handle")
			}
			key := keyOf(t, mw, rq)
			claim := tp.Named("idem.claim")[0]
			if !telemetrytest.Has(attribute.NewSet(claim.Attributes()...), telemetry.AttrOutcome.String("first"),
				telemetry.AttrKeyHash.String(key.Hash()), telemetry.AttrScope.String(route)) {
				t.Errorf("claim span attributes %v", claim.Attributes())
			}
			for _, s := range tp.Ended() {
				for _, kv := range s.Attributes() {
					if v := kv.Value.String(); strings.Contains(v, principal) || strings.Contains(v, "key-traced") {
						t.Errorf("span %s attribute %s = %q", s.Name(), kv.Key, v)
					}
				}
			}

			// A replay: only a claim span, with its outcome.
			do(t, nil, srv.URL, rq)
			claims := tp.Named("idem.claim")
			if len(claims) != 2 || !telemetrytest.Has(attribute.NewSet(claims[1].Attributes()...), telemetry.AttrOutcome.String("duplicate")) {
				t.Errorf("replay claim spans: %d", len(claims))
			}
		})
	}
}

// completeFails is a lease store whose Complete fails.
type completeFails struct{ dedup.LeaseStore }

func (completeFails) Complete(context.Context, *dedup.Lease, []byte) error {
	return errors.New("redis: connection reset by peer")
}

// TestLogsHoldNoKey: the warnings name the key by its hash, never the key
// or the principal.
func TestLogsHoldNoKey(t *testing.T) {
	t.Parallel()
	var logs telemetrytest.LogBuffer
	logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	down := newMem(t, memstore.Options{})
	_ = down.Close()
	rq := asTenant(req{key: "key-logged", body: "{}"})
	var key dedup.Key
	for _, store := range []dedup.LeaseStore{down, completeFails{newMem(t, memstore.Options{})}} {
		mw := newMW(t, store, httpidem.Options{Principal: byTenant, Telemetry: consumer.Telemetry{Logger: logger}})
		key = keyOf(t, mw, rq)
		do(t, nil, routed(t, mw.Handler(telHandler(nil, nil))).URL, rq)
	}
	out := logs.String()
	if strings.Count(out, "key_hash="+key.Hash()) != 2 {
		t.Errorf("want two warnings with key_hash=%s; logs:\n%s", key.Hash(), out)
	}
	if strings.Contains(out, "key-logged") || strings.Contains(out, principal) {
		t.Errorf("the logs hold the key or the principal:\n%s", out)
	}
}
