package outbox_test

import (
	"context"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/outbox"
)

// The default propagator writes the OpenTelemetry span of Enqueue's ctx as
// W3C Trace Context, ahead of WithTraceContext; WithTraceContext still
// works without a span, and an empty traceparent turns both off.
func TestTraceContextOTelSpan(t *testing.T) {
	tp := telemetrytest.NewSpans(t)
	ctx, span := tp.Tracer("test").Start(context.Background(), "checkout")
	defer span.End()
	sc := span.SpanContext()
	want := "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-01"

	h := outbox.InjectHeaders(ctx, outbox.TraceContext, nil)
	if h[outbox.HeaderTraceParent] != want {
		t.Fatalf("traceparent = %q, want %q (headers %v)", h[outbox.HeaderTraceParent], want, h)
	}
	got, ok := outbox.SpanContext(h)
	if !ok || got.TraceID() != sc.TraceID() || got.SpanID() != sc.SpanID() || !got.IsRemote() {
		t.Fatalf("SpanContext(%v) = %v, %v", h, got, ok)
	}

	// The span wins over WithTraceContext.
	withBoth := outbox.WithTraceContext(ctx, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "v=1")
	if h := outbox.InjectHeaders(withBoth, outbox.TraceContext, nil); h[outbox.HeaderTraceParent] != want || h[outbox.HeaderTraceState] != "" {
		t.Fatalf("span and WithTraceContext: %v, want the span's traceparent", h)
	}
	// An empty traceparent removes every trace context.
	if h := outbox.InjectHeaders(outbox.WithTraceContext(ctx, "", ""), outbox.TraceContext, nil); h != nil {
		t.Fatalf("removed trace context still written: %v", h)
	}
	// A span context that is not valid (no span) falls back to
	// WithTraceContext; baggage is not carried by default (a composite
	// propagator through OTelPropagator carries it).
	m, err := baggage.NewMember("tenant", "t1")
	if err != nil {
		t.Fatal(err)
	}
	bag, err := baggage.New(m)
	if err != nil {
		t.Fatal(err)
	}
	bctx := baggage.ContextWithBaggage(context.Background(), bag)
	h = outbox.InjectHeaders(outbox.WithTraceContext(bctx, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "v=1"), outbox.TraceContext, nil)
	if h[outbox.HeaderTraceParent] != "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" || h[outbox.HeaderTraceState] != "v=1" || h["baggage"] != "" {
		t.Fatalf("WithTraceContext with baggage: %v", h)
	}
	withBag := outbox.OTelPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	if h := outbox.InjectHeaders(bctx, withBag, nil); h["baggage"] != "tenant=t1" {
		t.Fatalf("composite propagator: %v, want baggage", h)
	}
	// A message's own traceparent keeps its own (absent) tracestate.
	traced := trace.ContextWithSpanContext(context.Background(), sc.WithTraceState(mustTraceState(t, "v=2")))
	h = outbox.InjectHeaders(traced, outbox.TraceContext, map[string]string{outbox.HeaderTraceParent: "mine"})
	if h[outbox.HeaderTraceParent] != "mine" || h[outbox.HeaderTraceState] != "" {
		t.Fatalf("own traceparent mixed with the propagated tracestate: %v", h)
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

func TestOTelPropagator(t *testing.T) {
	tp := telemetrytest.NewSpans(t)
	ctx, span := tp.Tracer("test").Start(context.Background(), "checkout")
	defer span.End()
	for _, p := range []outbox.Propagator{outbox.OTelPropagator(nil), outbox.OTelPropagator(propagation.TraceContext{})} {
		h := outbox.InjectHeaders(ctx, p, nil)
		if sc, ok := outbox.SpanContext(h); !ok || sc.SpanID() != span.SpanContext().SpanID() {
			t.Fatalf("OTelPropagator: %v", h)
		}
	}
	// It ignores WithTraceContext.
	if h := outbox.InjectHeaders(outbox.WithTraceContext(context.Background(), "00-aa-bb-01", ""), outbox.OTelPropagator(nil), nil); h != nil {
		t.Fatalf("OTelPropagator wrote %v without a span", h)
	}
}

// Hostile header values read as no trace context, never a panic.
func TestSpanContextHostile(t *testing.T) {
	for _, h := range []map[string]string{
		nil,
		{},
		{outbox.HeaderTraceParent: ""},
		{outbox.HeaderTraceParent: "garbage"},
		{outbox.HeaderTraceParent: "00-00000000000000000000000000000000-0000000000000000-01"},
		{outbox.HeaderTraceParent: strings.Repeat("0", 1<<20)},
		{outbox.HeaderTraceParent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" + strings.Repeat("x", 1<<20)},
	} {
		if sc, ok := outbox.SpanContext(h); ok {
			t.Errorf("SpanContext(%.80v) = %v, true", h, sc)
		}
	}
	// A huge tracestate is dropped, the traceparent kept.
	sc, ok := outbox.SpanContext(map[string]string{
		outbox.HeaderTraceParent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		outbox.HeaderTraceState:  "v=" + strings.Repeat("x", 1<<20),
	})
	if !ok || sc.TraceState().Len() != 0 {
		t.Errorf("SpanContext with a 1 MB tracestate = %v, %v", sc, ok)
	}
}
