package telemetry_test

import (
	"context"
	"os"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
)

// docs/operating.md's "Metrics" section lists every metric idem declares,
// the WAL relay's slot gauges included.
func TestOperatingDocListsEveryMetric(t *testing.T) {
	b, err := os.ReadFile("../../docs/operating.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	start := strings.Index(doc, "\n## Metrics\n")
	if start < 0 {
		t.Fatal(`docs/operating.md has no "## Metrics" section`)
	}
	section := doc[start+1:]
	if end := strings.Index(section[3:], "\n## "); end >= 0 {
		section = section[:end+3]
	}
	for _, m := range append(append([]string(nil), telemetry.Metrics...), telemetry.SlotMetrics...) {
		if !strings.Contains(section, "`"+m+"`") {
			t.Errorf("docs/operating.md's Metrics section does not list %s", m)
		}
	}
}

func TestStoreName(t *testing.T) {
	type local struct{}
	if got := telemetry.StoreName(&local{}); got != "telemetry_test" {
		t.Errorf("StoreName(local) = %q", got)
	}
	if got := telemetry.StoreName(nil); got != "custom" {
		t.Errorf("StoreName(nil) = %q", got)
	}
}

// Before the application installs a global provider, an adapter with no
// TracerProvider starts no consumer span; with one given, it does.
func TestTracingFastPath(t *testing.T) {
	if telemetry.Tracing(nil) {
		t.Fatal("Tracing(nil) with no global provider installed = true")
	}
	if telemetry.Tracing(noop.NewTracerProvider()) {
		t.Fatal("Tracing(noop) = true")
	}
	a := telemetry.NewAdapter(nil, nil, "kafka")
	ctx, end := a.StartConsumer(context.Background(), nil, propagation.MapCarrier{}, "orders")
	end("ack", nil)
	if trace.SpanFromContext(ctx).SpanContext().IsValid() {
		t.Fatal("a span was started with no provider")
	}
	tp := telemetrytest.NewSpans(t)
	if !telemetry.Tracing(tp) {
		t.Fatal("Tracing(sdk provider) = false")
	}
	b := telemetry.NewAdapter(nil, tp, "kafka")
	_, end = b.StartConsumer(context.Background(), nil, propagation.MapCarrier{}, "orders")
	end("ack", nil)
	if n := len(tp.Named("process orders")); n != 1 {
		t.Fatalf("%d consumer spans, want 1", n)
	}
}

// Scopes past MaxScopes share the overflow scope's instruments.
func TestScopesOverflow(t *testing.T) {
	s := telemetry.NewScopes(nil, nil, "memstore")
	if a, b := s.Get("orders"), s.Get("orders"); a != b || a.Scope() != "orders" || a.Store() != "memstore" {
		t.Fatalf("Get(orders) twice = %p %p (scope %q)", a, b, a.Scope())
	}
	for i := range telemetry.MaxScopes {
		s.Get(strings.Repeat("x", i+1))
	}
	over := s.Get("one-too-many")
	if over.Scope() != telemetry.OverflowScope || s.Get("and-another") != over {
		t.Fatalf("past MaxScopes: scope %q, want %q shared", over.Scope(), telemetry.OverflowScope)
	}
	if s.Get("orders").Scope() != "orders" {
		t.Fatal("a known scope lost its instruments")
	}
}
