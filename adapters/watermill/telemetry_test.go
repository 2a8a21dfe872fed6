package idemwatermill_test

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// telKind is a store for the telemetry tests: a middleware factory, a lease
// store on the same keys (to hold a key in flight), and the idem.store name.
type telKind struct {
	name  string
	setup func(t *testing.T) (mw func(idemwatermill.Options) message.HandlerMiddleware, hold dedup.LeaseStore)
}

func telKinds() []telKind {
	return []telKind{
		{"memstore", func(t *testing.T) (func(idemwatermill.Options) message.HandlerMiddleware, dedup.LeaseStore) {
			s := newMemstore(t)
			return func(o idemwatermill.Options) message.HandlerMiddleware { return must(idemwatermill.Dedup(s, o)) }, s
		}},
		{"redisnx", func(t *testing.T) (func(idemwatermill.Options) message.HandlerMiddleware, dedup.LeaseStore) {
			s := must(redisnx.New(testenv.Redis(t), redisnx.Options{Prefix: testenv.Name("idemwmtel")}))
			return func(o idemwatermill.Options) message.HandlerMiddleware { return must(idemwatermill.Dedup(s, o)) }, s
		}},
		{"pgtable", func(t *testing.T) (func(idemwatermill.Options) message.HandlerMiddleware, dedup.LeaseStore) {
			pool, schema := pgEnv(t)
			s := newPGStore(t, pool, schema, pgtable.Options{})
			return func(o idemwatermill.Options) message.HandlerMiddleware {
				return must(idemwatermill.Transactional(s, o))
			}, s.Lease()
		}},
	}
}

// TestMetricsByOutcome: every claim outcome and every verdict on a message
// through a router on gochannel lands on its own counter point, with the
// handler name as idem.scope, the store, the topic as destination, and
// never an id. Lease stores (memstore, redisnx) go through Dedup, pgtable
// through Transactional.
func TestMetricsByOutcome(t *testing.T) {
	t.Parallel()
	for _, k := range telKinds() {
		t.Run(k.name, func(t *testing.T) {
			mp := telemetrytest.NewMetrics(t)
			mwFor, hold := k.setup(t)
			held := atomic.Pointer[dedup.Lease]{}
			onOutcome := func(_ context.Context, r consumer.Report) {
				o := r.Outcome
				// The first delivery of evt-held finds it in flight;
				// the other owner finishes, and the redelivery runs.
				if o == "in_flight" {
					if l := held.Swap(nil); l != nil {
						if err := hold.Release(context.Background(), l); err != nil {
							t.Error(err)
						}
					}
				}
			}
			pq := must(middleware.PoisonQueue(&recordingPublisher{}, "poison"))
			ps := newGoChannel(t)
			r := newRouter(t)
			topic := testenv.Name("orders")
			r.AddMiddleware(mwFor(idemwatermill.Options{KeyMetadata: "event_id", PoisonQueue: pq, Telemetry: consumer.Telemetry{MeterProvider: mp, OnOutcome: onOutcome}}))
			var failed atomic.Bool
			r.AddConsumerHandler("charge", topic, ps, func(msg *message.Message) error {
				if msg.Metadata.Get("event_id") == "evt-fail" && failed.CompareAndSwap(false, true) {
					return errGateway // nacked, redelivered, runs again
				}
				return nil
			})
			startRouter(t, r)

			newMsg := func(id, payload string) *message.Message {
				m := message.NewMessage(wm.NewUUID(), []byte(payload))
				if id != "" {
					m.Metadata.Set("event_id", id)
				}
				return m
			}
			lease, err := hold.Claim(context.Background(), dedup.NewKey("charge", "evt-held", []byte("p")))
			if err != nil {
				t.Fatal(err)
			}
			held.Store(lease)
			for _, m := range []*message.Message{
				newMsg("evt-1", "p"),     // first, completed: ack
				newMsg("evt-1", "p"),     // duplicate: ack
				newMsg("evt-1", "other"), // fingerprint mismatch: dead letter
				newMsg("", "p"),          // invalid key: dead letter
				newMsg("evt-fail", "p"),  // first, released: retry; then first, completed: ack
				newMsg("evt-held", "p"),  // in flight: retry; then first, completed: ack
			} {
				if err := ps.Publish(topic, m); err != nil {
					t.Fatal(err)
				}
			}

			scope := telemetry.AttrScope.String("charge")
			store := telemetry.AttrStore.String(k.name)
			for _, c := range []struct {
				outcome string
				want    float64
			}{
				{telemetry.ClaimFirst, 4},
				{telemetry.ClaimDuplicate, 1},
				{telemetry.ClaimFingerprintMismatch, 1},
				{telemetry.ClaimInvalidKey, 1},
				{telemetry.ClaimInFlight, 1},
				{telemetry.ClaimError, 0},
			} {
				o := telemetry.AttrOutcome.String(c.outcome)
				if got := mp.Sum(telemetry.MetricClaims, scope, store, o); got != c.want {
					t.Errorf("%s{outcome=%s} = %v, want %v", telemetry.MetricClaims, c.outcome, got, c.want)
				}
				if got := mp.Sum(telemetry.MetricClaimDuration, scope, store, o); got != c.want {
					t.Errorf("%s{outcome=%s} count = %v, want %v", telemetry.MetricClaimDuration, c.outcome, got, c.want)
				}
			}
			for outcome, want := range map[string]float64{"completed": 3, "released": 1, "lease_lost": 0} {
				if got := mp.Sum(telemetry.MetricHandlerDuration, scope, store, telemetry.AttrOutcome.String(outcome)); got != want {
					t.Errorf("%s{outcome=%s} = %v, want %v", telemetry.MetricHandlerDuration, outcome, got, want)
				}
			}
			wmAttrs := []attribute.KeyValue{telemetry.AttrSystem.String("watermill"), telemetry.AttrDestination.String(topic)}
			for _, c := range []struct {
				result, reason string
				want           float64
			}{
				{"ack", "", 4},
				{"retry", "", 2},
				{"dead_letter", "fingerprint_mismatch", 1},
				{"dead_letter", "invalid_key", 1},
			} {
				attrs := append(slices.Clone(wmAttrs), telemetry.AttrResult.String(c.result))
				if c.reason != "" {
					attrs = append(attrs, telemetry.AttrReason.String(c.reason))
				}
				if got := mp.Sum(telemetry.MetricMessages, attrs...); got != c.want {
					t.Errorf("%s{result=%s,reason=%s} = %v, want %v", telemetry.MetricMessages, c.result, c.reason, got, c.want)
				}
			}
			if got := mp.Sum(telemetry.MetricProcessDuration, wmAttrs...); got != 8 {
				t.Errorf("%s count = %v, want 8 deliveries", telemetry.MetricProcessDuration, got)
			}
			mp.NoValueContains("evt-")
		})
	}
}

// TestMetricsStoreDown: a claim the store fails is a claim error and a
// retry; the id is in no attribute.
func TestMetricsStoreDown(t *testing.T) {
	t.Parallel()
	mp := telemetrytest.NewMetrics(t)
	down := &leaseStore{LeaseStore: newMemstore(t), claim: func(context.Context, dedup.Key) (*dedup.Lease, error) {
		return nil, errors.New("dial tcp 127.0.0.1:6379: connection refused")
	}}
	h := must(idemwatermill.Dedup(down, idemwatermill.Options{Scope: "billing/charge", StoreName: "down", Telemetry: consumer.Telemetry{MeterProvider: mp}}))(
		func(*message.Message) ([]*message.Message, error) { return nil, nil })
	msg := message.NewMessage("order-secret-1", []byte("p"))
	if _, err := h(msg); err == nil {
		t.Fatal("a store that is down let the message through")
	}
	if got := mp.Sum(telemetry.MetricClaims, telemetry.AttrScope.String("billing/charge"), telemetry.AttrStore.String("down"),
		telemetry.AttrOutcome.String(telemetry.ClaimError)); got != 1 {
		t.Errorf("claims{error} = %v, want 1", got)
	}
	if got := mp.Sum(telemetry.MetricMessages, telemetry.AttrResult.String("retry")); got != 1 {
		t.Errorf("messages{retry} = %v, want 1", got)
	}
	mp.NoValueContains("order-secret")
}

// TestMetricsLeaseLost: a lease lost while the handler runs is counted.
func TestMetricsLeaseLost(t *testing.T) {
	t.Parallel()
	mp := telemetrytest.NewMetrics(t)
	store := &leaseStore{LeaseStore: newMemstore(t), extend: func(context.Context, *dedup.Lease) error { return dedup.ErrLeaseLost }}
	h := must(idemwatermill.Dedup(store, idemwatermill.Options{Scope: "s", ExtendEvery: time.Millisecond, Telemetry: consumer.Telemetry{MeterProvider: mp}}))(
		func(m *message.Message) ([]*message.Message, error) {
			<-m.Context().Done()
			return nil, nil
		})
	if _, err := h(message.NewMessage(wm.NewUUID(), []byte("a"))); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("err = %v, want lease lost", err)
	}
	if got := mp.Sum(telemetry.MetricLeaseLost, telemetry.AttrScope.String("s"), telemetry.AttrStore.String("watermill_test")); got != 1 {
		t.Errorf("%s = %v, want 1", telemetry.MetricLeaseLost, got)
	}
	if got := mp.Sum(telemetry.MetricHandlerDuration, telemetry.AttrOutcome.String("lease_lost")); got != 1 {
		t.Errorf("handler duration{lease_lost} = %v, want 1", got)
	}
	if got := mp.Sum(telemetry.MetricMessages, telemetry.AttrResult.String("retry")); got != 1 {
		t.Errorf("messages{retry} = %v, want 1", got)
	}
}

// producerSpan starts the producer's span and returns the message carrying
// its trace context in the metadata, as traceparent.
func producerSpan(t *testing.T, tp trace.TracerProvider, payload string) (trace.Span, *message.Message) {
	t.Helper()
	ctx, span := tp.Tracer("producer").Start(context.Background(), "send orders", trace.WithSpanKind(trace.SpanKindProducer))
	msg := message.NewMessage(wm.NewUUID(), []byte(payload))
	propagation.TraceContext{}.Inject(ctx, idemwatermill.MetadataCarrier(msg.Metadata))
	if msg.Metadata.Get("traceparent") == "" {
		t.Fatal("no traceparent injected")
	}
	span.End()
	return span, msg
}

// onlySpan returns the one ended span called name.
func onlySpan(t *testing.T, tp *telemetrytest.Spans, name string) sdktrace.ReadOnlySpan {
	t.Helper()
	spans := tp.Named(name)
	if len(spans) != 1 {
		var names []string
		for _, s := range tp.Ended() {
			names = append(names, s.Name())
		}
		t.Fatalf("%d %q spans, want 1; ended: %v", len(spans), name, names)
	}
	return spans[0]
}

// TestTraceContinuesFromMetadata: a span started before the message was
// created, injected into its metadata, is the parent of the middleware's
// consumer span after a trip through a real pub/sub (gochannel and a
// router), on Dedup and on Transactional; the idem spans are children of the
// consumer span and the handler runs under idem.handle.
func TestTraceContinuesFromMetadata(t *testing.T) {
	t.Parallel()
	for _, k := range telKinds() {
		if k.name == "redisnx" {
			continue // the same code path as memstore
		}
		t.Run(k.name, func(t *testing.T) {
			tp := telemetrytest.NewSpans(t)
			mwFor, _ := k.setup(t)
			ps := newGoChannel(t)
			r := newRouter(t)
			topic := testenv.Name("orders")
			r.AddMiddleware(mwFor(idemwatermill.Options{Telemetry: consumer.Telemetry{TracerProvider: tp}}))
			var handlerSpan trace.SpanContext
			r.AddConsumerHandler("charge", topic, ps, func(msg *message.Message) error {
				handlerSpan = trace.SpanContextFromContext(msg.Context())
				return nil
			})
			startRouter(t, r)

			producer, msg := producerSpan(t, tp, "p")
			if err := ps.Publish(topic, msg); err != nil {
				t.Fatal(err)
			}
			process := onlySpan(t, tp, "process "+topic)
			if process.Parent().SpanID() != producer.SpanContext().SpanID() || process.SpanContext().TraceID() != producer.SpanContext().TraceID() {
				t.Fatalf("consumer span's parent is %v, want the producer span %v", process.Parent(), producer.SpanContext())
			}
			if !process.Parent().IsRemote() || process.SpanKind() != trace.SpanKindConsumer {
				t.Errorf("consumer span: remote parent %v, kind %v", process.Parent().IsRemote(), process.SpanKind())
			}
			attrs := attribute.NewSet(process.Attributes()...)
			if !telemetrytest.Has(attrs, telemetry.AttrSystem.String("watermill"), telemetry.AttrDestination.String(topic), telemetry.AttrResult.String("ack")) {
				t.Errorf("consumer span attributes %v", process.Attributes())
			}
			for _, name := range []string{"idem.claim", "idem.handle"} {
				if s := onlySpan(t, tp, name); s.Parent().SpanID() != process.SpanContext().SpanID() {
					t.Errorf("%s's parent is %v, want the consumer span", name, s.Parent().SpanID())
				}
			}
			finish := "idem.complete"
			if k.name == "pgtable" {
				finish = "idem.commit"
			}
			if s := onlySpan(t, tp, finish); s.Parent().SpanID() != process.SpanContext().SpanID() {
				t.Errorf("%s's parent is %v, want the consumer span", finish, s.Parent().SpanID())
			}
			if handlerSpan.SpanID() != onlySpan(t, tp, "idem.handle").SpanContext().SpanID() {
				t.Error("the handler does not run under idem.handle")
			}
			claim := onlySpan(t, tp, "idem.claim")
			if !telemetrytest.Has(attribute.NewSet(claim.Attributes()...), telemetry.AttrOutcome.String("first"),
				telemetry.AttrScope.String("charge"), telemetry.AttrKeyHash.String(dedup.HashKey("charge", msg.UUID))) {
				t.Errorf("claim span attributes %v", claim.Attributes())
			}
			for _, s := range tp.Ended() {
				for _, kv := range s.Attributes() {
					if strings.Contains(kv.Value.String(), msg.UUID) {
						t.Errorf("span %s attribute %s holds the message id", s.Name(), kv.Key)
					}
				}
			}
		})
	}
}

// TestTraceUnderOuterSpan: when msg.Context() already holds a recording
// span (an OpenTelemetry middleware further out), the middleware starts no
// consumer span of its own: the idem spans are that span's children.
func TestTraceUnderOuterSpan(t *testing.T) {
	t.Parallel()
	tp := telemetrytest.NewSpans(t)
	ps := newGoChannel(t)
	r := newRouter(t)
	topic := testenv.Name("orders")
	var outer trace.SpanContext
	r.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx, span := tp.Tracer("watermill-otel").Start(msg.Context(), "outer")
			defer span.End()
			outer = span.SpanContext()
			msg.SetContext(ctx)
			return h(msg)
		}
	}, must(idemwatermill.Dedup(newMemstore(t), idemwatermill.Options{Telemetry: consumer.Telemetry{TracerProvider: tp}})))
	r.AddConsumerHandler("charge", topic, ps, func(*message.Message) error { return nil })
	startRouter(t, r)
	if err := ps.Publish(topic, message.NewMessage(wm.NewUUID(), []byte("p"))); err != nil {
		t.Fatal(err)
	}
	if n := len(tp.Named("process " + topic)); n != 0 {
		t.Errorf("%d consumer spans under an outer span, want 0", n)
	}
	for _, name := range []string{"idem.claim", "idem.handle", "idem.complete"} {
		if s := onlySpan(t, tp, name); s.Parent().SpanID() != outer.SpanID() {
			t.Errorf("%s's parent is %v, want the outer span", name, s.Parent().SpanID())
		}
	}
}

// TestTraceHostileMetadata: a megabyte traceparent, garbage, and a
// malformed tracestate and baggage do not panic the carrier or the
// propagator; the consumer span starts a new trace.
func TestTraceHostileMetadata(t *testing.T) {
	t.Parallel()
	tp := telemetrytest.NewSpans(t)
	h := must(idemwatermill.Dedup(newMemstore(t), idemwatermill.Options{Scope: "s", Telemetry: consumer.Telemetry{TracerProvider: tp}}))(
		func(*message.Message) ([]*message.Message, error) { return nil, nil })
	valid := "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	for i, md := range []message.Metadata{
		{"traceparent": valid + strings.Repeat("x", 1<<20)},
		{"traceparent": strings.Repeat("0", 1<<20)},
		{"traceparent": "\x00\xff garbage -- \n", "tracestate": strings.Repeat("a=b,", 1<<18), "baggage": strings.Repeat("%", 1<<20)},
		{"traceparent": "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
		{"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"},
		nil,
	} {
		msg := message.NewMessage(wm.NewUUID(), []byte("p"))
		msg.Metadata = md
		if _, err := h(msg); err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
	}
	spans := tp.Named("process ")
	if len(spans) != 6 {
		t.Fatalf("%d consumer spans, want 6", len(spans))
	}
	for i, s := range spans {
		if s.Parent().IsValid() {
			t.Errorf("message %d: the consumer span has parent %v, want a new root", i, s.Parent())
		}
	}
	// A value just under the bound is still read.
	msg := message.NewMessage(wm.NewUUID(), []byte("p"))
	msg.Metadata.Set("traceparent", valid)
	if got := idemwatermill.MetadataCarrier(msg.Metadata).Get("traceparent"); got != valid {
		t.Errorf("carrier read %q", got)
	}
	msg.Metadata.Set("traceparent", strings.Repeat("x", 8<<10+1))
	if got := idemwatermill.MetadataCarrier(msg.Metadata).Get("traceparent"); got != "" {
		t.Error("a value over 8 KiB was read")
	}
}

// TestPublisherKeepsTraceContext: the traceparent and tracestate headers of
// an outbox message reach the Watermill metadata unchanged, and the
// consumer's span continues that trace.
func TestPublisherKeepsTraceContext(t *testing.T) {
	t.Parallel()
	tp := telemetrytest.NewSpans(t)
	ps := newGoChannel(t)
	r := newRouter(t)
	topic := testenv.Name("receipts")
	got := make(chan *message.Message, 1)
	r.AddConsumerHandler("email", topic, ps, func(msg *message.Message) error {
		got <- msg
		return nil
	}).AddMiddleware(must(idemwatermill.Dedup(newMemstore(t), idemwatermill.Options{Telemetry: consumer.Telemetry{TracerProvider: tp}})))
	startRouter(t, r)

	const (
		parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
		state  = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
	)
	pub := must(idemwatermill.NewPublisher(ps))
	err := pub.Publish(context.Background(), []*outbox.Message{{
		ID: wm.NewUUID(), Topic: topic, Payload: []byte("p"),
		Headers: map[string]string{outbox.HeaderTraceParent: parent, outbox.HeaderTraceState: state},
	}})
	if err != nil {
		t.Fatal(err)
	}
	m := <-got
	if m.Metadata.Get("traceparent") != parent || m.Metadata.Get("tracestate") != state {
		t.Errorf("metadata traceparent %q tracestate %q, want them unchanged", m.Metadata.Get("traceparent"), m.Metadata.Get("tracestate"))
	}
	process := onlySpan(t, tp, "process "+topic)
	if process.Parent().TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || process.Parent().SpanID().String() != "00f067aa0ba902b7" {
		t.Errorf("consumer span's parent %v, want the outbox row's traceparent", process.Parent())
	}
	if process.Parent().TraceState().String() != state {
		t.Errorf("tracestate %q, want %q", process.Parent().TraceState().String(), state)
	}
}

// TestTraceThroughOutbox: consume, write and produce keeps one trace. A
// producer span is the parent of the upstream consumer span; the handler,
// under Transactional with the outbox, returns a message, which the outbox
// stores with the trace context of idem.handle (pgoutbox's Propagator set to
// OpenTelemetry's); the relay publishes it through Publisher and the
// downstream consumer span is a child of the upstream idem.handle span.
func TestTraceThroughOutbox(t *testing.T) {
	t.Parallel()
	tp := telemetrytest.NewSpans(t)
	fx := pgTxKind().setup(t)
	ob := must(pgoutbox.New(fx.pool, pgoutbox.Options{Schema: fx.schema, Logger: slog.New(slog.DiscardHandler),
		Propagator: propagation.TraceContext{}}))
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	upstream := newGoChannel(t)
	downstream := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 4}, nopLogger)
	t.Cleanup(func() { _ = downstream.Close() })
	relay := must(pgoutbox.NewRelay(ob, must(idemwatermill.NewPublisher(downstream)), pgoutbox.RelayOptions{Shards: 1, PollInterval: 50 * time.Millisecond, CleanupInterval: -1}))
	ctx, cancel := context.WithCancel(context.Background())
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-relayDone; err != nil {
			t.Errorf("relay: %v", err)
		}
	})

	done := make(chan struct{})
	r := newRouter(t)
	r.AddHandler("charge", "orders", upstream, "receipts", &recordingPublisher{},
		func(msg *message.Message) ([]*message.Message, error) {
			return []*message.Message{message.NewMessage(wm.NewUUID(), []byte("receipt"))}, nil
		}).AddMiddleware(fx.middleware(t, idemwatermill.Options{Outbox: ob, Telemetry: consumer.Telemetry{TracerProvider: tp}}))
	r.AddConsumerHandler("email", "receipts", downstream, func(*message.Message) error {
		close(done)
		return nil
	}).AddMiddleware(must(idemwatermill.Dedup(newMemstore(t), idemwatermill.Options{Telemetry: consumer.Telemetry{TracerProvider: tp}})))
	startRouter(t, r)

	producer, msg := producerSpan(t, tp, "order")
	if err := upstream.Publish("orders", msg); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(time.Minute): // a hang guard, not a timing assertion
		t.Fatal("the receipt never arrived downstream")
	}
	up := onlySpan(t, tp, "process orders")
	if up.Parent().SpanID() != producer.SpanContext().SpanID() {
		t.Fatalf("upstream consumer span's parent %v, want the producer span", up.Parent())
	}
	var handle sdktrace.ReadOnlySpan
	for _, s := range tp.Named("idem.handle") {
		if s.Parent().SpanID() == up.SpanContext().SpanID() {
			handle = s
		}
	}
	if handle == nil {
		t.Fatal("no idem.handle span under the upstream consumer span")
	}
	// The downstream handler returned; its span ends right after.
	var down sdktrace.ReadOnlySpan
	testenv.Eventually(t, time.Minute, "the downstream consumer span", func() bool {
		if s := tp.Named("process receipts"); len(s) == 1 {
			down = s[0]
		}
		return down != nil
	})
	if down.Parent().SpanID() != handle.SpanContext().SpanID() || down.SpanContext().TraceID() != producer.SpanContext().TraceID() {
		t.Errorf("downstream consumer span's parent %v (trace %v), want the upstream idem.handle %v in the producer's trace",
			down.Parent().SpanID(), down.SpanContext().TraceID(), handle.SpanContext().SpanID())
	}
}

// TestNoProviderNoSpans: without providers (the globals, no-ops until the
// application installs its own) the middleware neither starts spans nor
// changes what the handler sees in msg.Context() beyond its own values.
func TestNoProviderNoSpans(t *testing.T) {
	t.Parallel()
	h := must(idemwatermill.Dedup(newMemstore(t), idemwatermill.Options{Scope: "s"}))(
		func(m *message.Message) ([]*message.Message, error) {
			if trace.SpanFromContext(m.Context()).IsRecording() {
				t.Error("a recording span without a provider")
			}
			return nil, nil
		})
	_, msg := producerSpan(t, telemetrytest.NewSpans(t), "p")
	if _, err := h(msg); err != nil {
		t.Fatal(err)
	}
}

// TestLogsHoldNoID: the warnings name the key by its hash, never the
// message id.
func TestLogsHoldNoID(t *testing.T) {
	t.Parallel()
	var logs strings.Builder
	logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	store := &leaseStore{LeaseStore: newMemstore(t), complete: func(context.Context, *dedup.Lease) error {
		return errors.New("redis: connection reset by peer")
	}}
	h := must(idemwatermill.Dedup(store, idemwatermill.Options{Scope: "billing/charge", Telemetry: consumer.Telemetry{Logger: logger}}))(
		func(*message.Message) ([]*message.Message, error) { return nil, nil })
	msg := message.NewMessage("order-secret-7", []byte("p"))
	if _, err := h(msg); err == nil {
		t.Fatal("a failed complete was acknowledged")
	} else if strings.Contains(err.Error(), "order-secret-7") {
		t.Errorf("the error holds the id: %v", err)
	}
	out := logs.String()
	if !strings.Contains(out, "key_hash="+dedup.HashKey("billing/charge", "order-secret-7")) || strings.Contains(out, "order-secret") {
		t.Errorf("logs:\n%s", out)
	}
}

// TestTelemetryPanic: a panicking handler ends its spans (with an error)
// and counts as a retry and a released key, on Dedup and Transactional.
func TestTelemetryPanic(t *testing.T) {
	t.Parallel()
	for _, k := range telKinds() {
		if k.name == "redisnx" {
			continue
		}
		t.Run(k.name, func(t *testing.T) {
			mp, tp := telemetrytest.NewMetrics(t), telemetrytest.NewSpans(t)
			mwFor, _ := k.setup(t)
			h := mwFor(idemwatermill.Options{Scope: "s", Telemetry: consumer.Telemetry{MeterProvider: mp, TracerProvider: tp}})(
				func(*message.Message) ([]*message.Message, error) { panic("boom") })
			func() {
				defer func() { _ = recover() }()
				_, _ = h(message.NewMessage(wm.NewUUID(), []byte("p")))
			}()
			if got := mp.Sum(telemetry.MetricMessages, telemetry.AttrResult.String("retry")); got != 1 {
				t.Errorf("messages{retry} = %v, want 1", got)
			}
			if got := mp.Sum(telemetry.MetricHandlerDuration, telemetry.AttrOutcome.String("released")); got != 1 {
				t.Errorf("handler{released} = %v, want 1", got)
			}
			for _, name := range []string{"process ", "idem.handle"} {
				if s := onlySpan(t, tp, name); s.Status().Code != codes.Error {
					t.Errorf("%s status %v, want an error", name, s.Status())
				}
			}
		})
	}
}
