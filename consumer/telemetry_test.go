package consumer_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/clocktest"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
)

// Every claim outcome and every way a handler ends lands on its own
// counter point, with scope and store attributes and never the id.
func TestDedupMetricsByOutcome(t *testing.T) {
	mp := telemetrytest.NewMetrics(t)
	store := newStore(t, memstore.Options{})
	fail := errors.New("boom")
	h := consumer.Chain(consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		if m.ID == "order-fails" {
			return fail
		}
		return nil
	}), mustDedup(t, store, consumer.DedupOptions{Scope: "billing/charge", Telemetry: consumer.Telemetry{MeterProvider: mp}}))

	consumer.Process(t.Context(), h, msg("order-1", "p"))     // first, completed
	consumer.Process(t.Context(), h, msg("order-1", "p"))     // duplicate
	consumer.Process(t.Context(), h, msg("order-1", "other")) // fingerprint mismatch
	consumer.Process(t.Context(), h, msg("", "p"))            // invalid key
	consumer.Process(t.Context(), h, msg("order-fails", "p")) // first, released
	held, err := store.Claim(t.Context(), dedup.NewKey("billing/charge", "order-held", []byte("p")))
	if err != nil {
		t.Fatal(err)
	}
	consumer.Process(t.Context(), h, msg("order-held", "p")) // in flight
	_ = store.Release(t.Context(), held)

	closed := newStore(t, memstore.Options{})
	_ = closed.Close()
	hc := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }),
		mustDedup(t, closed, consumer.DedupOptions{Scope: "billing/charge", Telemetry: consumer.Telemetry{MeterProvider: mp}, StoreName: "down"}))
	consumer.Process(t.Context(), hc, msg("order-2", "p")) // error

	scope := telemetry.AttrScope.String("billing/charge")
	mem := telemetry.AttrStore.String("memstore")
	for _, c := range []struct {
		outcome string
		store   attribute.KeyValue
		want    float64
	}{
		{telemetry.ClaimFirst, mem, 2},
		{telemetry.ClaimDuplicate, mem, 1},
		{telemetry.ClaimFingerprintMismatch, mem, 1},
		{telemetry.ClaimInvalidKey, mem, 1},
		{telemetry.ClaimInFlight, mem, 1},
		{telemetry.ClaimError, telemetry.AttrStore.String("down"), 1},
	} {
		o := telemetry.AttrOutcome.String(c.outcome)
		if got := mp.Sum(telemetry.MetricClaims, scope, c.store, o); got != c.want {
			t.Errorf("%s{outcome=%s} = %v, want %v", telemetry.MetricClaims, c.outcome, got, c.want)
		}
		if got := mp.Sum(telemetry.MetricClaimDuration, scope, c.store, o); got != c.want {
			t.Errorf("%s{outcome=%s} count = %v, want %v", telemetry.MetricClaimDuration, c.outcome, got, c.want)
		}
	}
	if got := mp.Sum(telemetry.MetricClaims); got != 7 {
		t.Errorf("claims in all = %v, want 7", got)
	}
	for outcome, want := range map[string]float64{"completed": 1, "released": 1} {
		if got := mp.Sum(telemetry.MetricHandlerDuration, scope, mem, telemetry.AttrOutcome.String(outcome)); got != want {
			t.Errorf("%s{outcome=%s} = %v, want %v", telemetry.MetricHandlerDuration, outcome, got, want)
		}
	}
	mp.NoValueContains("order-")
}

func TestDedupMetricsLeaseLost(t *testing.T) {
	mp := telemetrytest.NewMetrics(t)
	clock := clocktest.NewManual(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	store := newStore(t, memstore.Options{Lease: time.Second, Clock: clock})
	started := make(chan struct{})
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
		close(started)
		<-ctx.Done()
		return ctx.Err()
	}), mustDedup(t, store, consumer.DedupOptions{Scope: "s", ExtendEvery: 2 * time.Millisecond, Telemetry: consumer.Telemetry{MeterProvider: mp}}))
	done := make(chan struct{})
	go func() { defer close(done); consumer.Process(t.Context(), h, msg("m1", "p")) }()
	<-started
	clock.Advance(2 * time.Second)
	if _, err := store.Claim(t.Context(), dedup.NewKey("s", "m1", []byte("p"))); err != nil {
		t.Fatal(err)
	}
	<-done
	if got := mp.Sum(telemetry.MetricLeaseLost, telemetry.AttrScope.String("s")); got != 1 {
		t.Fatalf("%s = %v, want 1", telemetry.MetricLeaseLost, got)
	}
	if got := mp.Sum(telemetry.MetricHandlerDuration, telemetry.AttrOutcome.String("lease_lost")); got != 1 {
		t.Fatalf("handler duration{lease_lost} = %v, want 1", got)
	}
}

// Retry records how long a message waited on a key in flight elsewhere and
// how the wait ended.
func TestRetryRecordsLeaseWait(t *testing.T) {
	mp := telemetrytest.NewMetrics(t)
	store := newStore(t, memstore.Options{})
	held, err := store.Claim(t.Context(), dedup.NewKey("s", "m1", []byte("p")))
	if err != nil {
		t.Fatal(err)
	}
	sleeps := 0
	retry := mustRetry(t, consumer.RetryOptions{MaxAttempts: 5, MeterProvider: mp,
		Sleep: func(context.Context, time.Duration) error {
			sleeps++
			if sleeps == 2 { // the other owner finishes while we wait
				return store.Complete(t.Context(), held, nil)
			}
			return nil
		}})
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }),
		retry, mustDedup(t, store, consumer.DedupOptions{Scope: "s"}))
	r := consumer.Process(t.Context(), h, msg("m1", "p"))
	if !errors.Is(r.Err, dedup.ErrDuplicate) {
		t.Fatalf("result %v, want a duplicate once the owner completed", r.Err)
	}
	if got := mp.Sum(telemetry.MetricLeaseWait, telemetry.AttrWaitOutcome.String("duplicate")); got != 1 {
		t.Fatalf("%s{duplicate} = %v, want 1 wait", telemetry.MetricLeaseWait, got)
	}
}

// Under a recording span (an adapter's consumer span) Dedup adds claim,
// handle and complete spans as its children, with the key's hash and
// never the key.
func TestDedupSpans(t *testing.T) {
	tp := telemetrytest.NewSpans(t)
	store := newStore(t, memstore.Options{})
	var handlerSpan trace.SpanContext
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
		handlerSpan = trace.SpanContextFromContext(ctx)
		return nil
	}), mustDedup(t, store, consumer.DedupOptions{Scope: "billing/charge", Telemetry: consumer.Telemetry{TracerProvider: tp}}))

	// Without a recording parent, no spans at all.
	consumer.Process(t.Context(), h, msg("order-0", "p"))
	if n := len(tp.Ended()); n != 0 {
		t.Fatalf("%d spans without a parent span, want 0", n)
	}

	ctx, root := tp.Tracer("test").Start(t.Context(), "process orders")
	consumer.Process(ctx, h, msg("order-1", "p"))
	root.End()
	for _, name := range []string{"idem.claim", "idem.handle", "idem.complete"} {
		spans := tp.Named(name)
		if len(spans) != 1 {
			t.Fatalf("%d %s spans, want 1", len(spans), name)
		}
		if spans[0].Parent().SpanID() != root.SpanContext().SpanID() {
			t.Errorf("%s parent = %v, want the consumer span", name, spans[0].Parent().SpanID())
		}
	}
	if handlerSpan.SpanID() != tp.Named("idem.handle")[0].SpanContext().SpanID() {
		t.Error("the handler does not run under the idem.handle span")
	}
	claim := tp.Named("idem.claim")[0]
	attrs := attribute.NewSet(claim.Attributes()...)
	if !telemetrytest.Has(attrs, telemetry.AttrOutcome.String("first"),
		telemetry.AttrKeyHash.String(dedup.HashKey("billing/charge", "order-1"))) {
		t.Errorf("claim span attributes %v", claim.Attributes())
	}
	for _, sp := range tp.Ended() {
		for _, kv := range sp.Attributes() {
			if strings.Contains(kv.Value.String(), "order-1") {
				t.Errorf("span %s attribute %s holds the id", sp.Name(), kv.Key)
			}
		}
	}
}

// Transactional's spans: claim, handle and commit under the consumer span;
// a panicking handler still ends its handle span, with an error.
func TestTransactionalSpans(t *testing.T) {
	tp := telemetrytest.NewSpans(t)
	store := newTxStore()
	h, err := consumer.Transactional(store, consumer.TxOptions{Scope: "ledger", Telemetry: consumer.Telemetry{TracerProvider: tp}},
		func(_ context.Context, tx *fakeTx, m *consumer.Message) error {
			if m.ID == "boom" {
				panic("handler exploded")
			}
			tx.writes = append(tx.writes, m.ID)
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	ctx, root := tp.Tracer("test").Start(t.Context(), "process ledger")
	consumer.Process(ctx, h, msg("order-1", "p"))
	consumer.Process(ctx, consumer.Chain(h, consumer.Recover()), msg("boom", "p"))
	root.End()
	if n := len(tp.Named("idem.commit")); n != 1 {
		t.Fatalf("%d commit spans, want 1", n)
	}
	handles := tp.Named("idem.handle")
	if len(handles) != 2 {
		t.Fatalf("%d handle spans, want 2 (the panicking one ended too)", len(handles))
	}
	failed := 0
	for _, s := range handles {
		if s.Parent().SpanID() != root.SpanContext().SpanID() {
			t.Errorf("handle span parent %v, want the consumer span", s.Parent().SpanID())
		}
		if s.Status().Code == codes.Error {
			failed++
		}
	}
	if failed != 1 {
		t.Errorf("%d handle spans with an error status, want 1 (the panic)", failed)
	}
}
