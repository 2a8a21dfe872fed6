package outbox_test

import (
	"context"
	"errors"
	"testing"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, testenv.LeakOptions()...) }

func TestTraceContext(t *testing.T) {
	ctx := context.Background()
	if _, _, ok := outbox.TraceContextFrom(ctx); ok {
		t.Fatal("trace context in a bare context")
	}
	if h := outbox.InjectHeaders(ctx, outbox.TraceContext, nil); h != nil {
		t.Fatalf("headers without trace context = %v, want nil", h)
	}
	ctx = outbox.WithTraceContext(ctx, "00-aa-bb-01", "")
	h := outbox.InjectHeaders(ctx, outbox.TraceContext, map[string]string{"x": "1"})
	if h[outbox.HeaderTraceParent] != "00-aa-bb-01" || h["x"] != "1" {
		t.Fatalf("headers = %v", h)
	}
	if _, ok := h[outbox.HeaderTraceState]; ok {
		t.Fatalf("empty tracestate sent: %v", h)
	}
	// A message's own header wins; the input map is not modified.
	own := map[string]string{outbox.HeaderTraceParent: "mine"}
	h = outbox.InjectHeaders(ctx, outbox.TraceContext, own)
	if h[outbox.HeaderTraceParent] != "mine" || len(own) != 1 {
		t.Fatalf("headers = %v, input %v", h, own)
	}
	// An empty traceparent removes the trace context.
	if _, _, ok := outbox.TraceContextFrom(outbox.WithTraceContext(ctx, "", "x")); ok {
		t.Fatal("trace context after WithTraceContext(ctx, \"\", ...)")
	}
	// A nil propagator adds nothing.
	if h := outbox.InjectHeaders(ctx, nil, nil); h != nil {
		t.Fatalf("nil propagator: %v", h)
	}
}

func TestPublishError(t *testing.T) {
	err := error(&outbox.PublishError{Failed: map[int]error{3: errors.New("c"), 1: errors.New("a")}})
	if got, want := err.Error(), "outbox: 2 of the batch not confirmed: #1: a; #3: c"; got != want {
		t.Fatalf("Error() = %q, want %q", got, want)
	}
	var pe *outbox.PublishError
	if !errors.As(err, &pe) || len(pe.Failed) != 2 {
		t.Fatal("errors.As")
	}
	var m outbox.Metrics = outbox.NopMetrics{}
	m.Published("t", 1)
	m.Retried("t", 1)
	m.Dead("t", 1)
	m.Backlog(1, 0)
}
