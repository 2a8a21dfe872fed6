package telemetry_test

import (
	"context"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/outbox"
)

// The default propagator writes the OpenTelemetry span of Enqueue's ctx as
// W3C Trace Context; baggage only travels through a propagator that
// carries it, and a message's own traceparent wins.
func TestInjectHeadersSpan(t *testing.T) {
	tp := telemetrytest.NewSpans(t)
	ctx, span := tp.Tracer("test").Start(context.Background(), "checkout")
	defer span.End()
	sc := span.SpanContext()
	want := "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-01"

	for _, p := range []propagation.TextMapPropagator{nil, telemetry.DefaultPropagator, propagation.TraceContext{}} {
		h := telemetry.InjectHeaders(ctx, p, nil)
		if h[outbox.HeaderTraceParent] != want {
			t.Fatalf("propagator %T: traceparent = %q, want %q (headers %v)", p, h[outbox.HeaderTraceParent], want, h)
		}
		got, ok := telemetry.HeadersSpanContext(h)
		if !ok || got.TraceID() != sc.TraceID() || got.SpanID() != sc.SpanID() || !got.IsRemote() {
			t.Fatalf("HeadersSpanContext(%v) = %v, %v", h, got, ok)
		}
	}

	// Baggage is not carried by default; a composite propagator carries it.
	m, err := baggage.NewMember("tenant", "t1")
	if err != nil {
		t.Fatal(err)
	}
	bag, err := baggage.New(m)
	if err != nil {
		t.Fatal(err)
	}
	bctx := baggage.ContextWithBaggage(ctx, bag)
	if h := telemetry.InjectHeaders(bctx, nil, nil); h[outbox.HeaderTraceParent] != want || h["baggage"] != "" {
		t.Fatalf("default propagator with baggage: %v", h)
	}
	withBag := propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	if h := telemetry.InjectHeaders(bctx, withBag, nil); h["baggage"] != "tenant=t1" || h[outbox.HeaderTraceParent] != want {
		t.Fatalf("composite propagator: %v, want baggage", h)
	}
	// A propagator that carries nothing writes nothing.
	if h := telemetry.InjectHeaders(ctx, propagation.NewCompositeTextMapPropagator(), nil); h != nil {
		t.Fatalf("empty propagator wrote %v", h)
	}
	// A message's own traceparent keeps its own (absent) tracestate.
	traced := trace.ContextWithSpanContext(context.Background(), sc.WithTraceState(mustTraceState(t, "v=2")))
	h := telemetry.InjectHeaders(traced, nil, map[string]string{outbox.HeaderTraceParent: "mine"})
	if h[outbox.HeaderTraceParent] != "mine" || h[outbox.HeaderTraceState] != "" {
		t.Fatalf("own traceparent mixed with the propagated tracestate: %v", h)
	}
}

// Without a span, nothing is written; a traceparent the application
// received and extracted (OpenTelemetry's API, no SDK) is passed on with
// its tracestate, and the message's own headers win and stay unmodified.
func TestInjectHeadersRemote(t *testing.T) {
	ctx := context.Background()
	if h := telemetry.InjectHeaders(ctx, nil, nil); h != nil {
		t.Fatalf("headers without trace context = %v, want nil", h)
	}
	if h := telemetry.InjectHeaders(ctx, nil, map[string]string{"x": "1"}); len(h) != 1 || h["x"] != "1" {
		t.Fatalf("headers without trace context = %v, want only x", h)
	}
	const parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	ctx = propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier{outbox.HeaderTraceParent: parent, outbox.HeaderTraceState: "v=1"})
	h := telemetry.InjectHeaders(ctx, nil, map[string]string{"x": "1"})
	if h[outbox.HeaderTraceParent] != parent || h[outbox.HeaderTraceState] != "v=1" || h["x"] != "1" {
		t.Fatalf("headers = %v", h)
	}
	noState := propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier{outbox.HeaderTraceParent: parent})
	if h := telemetry.InjectHeaders(noState, nil, nil); h[outbox.HeaderTraceParent] != parent {
		t.Fatalf("headers = %v", h)
	} else if _, ok := h[outbox.HeaderTraceState]; ok {
		t.Fatalf("empty tracestate sent: %v", h)
	}
	own := map[string]string{outbox.HeaderTraceParent: "mine"}
	h = telemetry.InjectHeaders(ctx, nil, own)
	if h[outbox.HeaderTraceParent] != "mine" || len(own) != 1 {
		t.Fatalf("headers = %v, input %v", h, own)
	}
}

func mustTraceState(t *testing.T, s string) trace.TraceState {
	t.Helper()
	ts, err := trace.ParseTraceState(s)
	if err != nil {
		t.Fatal(err)
	}
	return ts
}

// Hostile header values read as no trace context, never a panic.
func TestHeadersSpanContextHostile(t *testing.T) {
	for _, h := range []map[string]string{
		nil,
		{},
		{outbox.HeaderTraceParent: ""},
		{outbox.HeaderTraceParent: "garbage"},
		{outbox.HeaderTraceParent: "00-00000000000000000000000000000000-0000000000000000-01"},
		{outbox.HeaderTraceParent: strings.Repeat("0", 1<<20)},
		{outbox.HeaderTraceParent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" + strings.Repeat("x", 1<<20)},
	} {
		if sc, ok := telemetry.HeadersSpanContext(h); ok {
			t.Errorf("HeadersSpanContext(%.80v) = %v, true", h, sc)
		}
	}
	// A huge tracestate is dropped, the traceparent kept.
	sc, ok := telemetry.HeadersSpanContext(map[string]string{
		outbox.HeaderTraceParent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		outbox.HeaderTraceState:  "v=" + strings.Repeat("x", 1<<20),
	})
	if !ok || sc.TraceState().Len() != 0 {
		t.Errorf("HeadersSpanContext with a 1 MB tracestate = %v, %v", sc, ok)
	}
}
