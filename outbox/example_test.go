package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sort"

	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/idemkit/idem/outbox"
)

// The trace context of the request that enqueues a message is stored with
// it and sent as its traceparent and tracestate headers.
func ExampleWithTraceContext() {
	ctx := outbox.WithTraceContext(context.Background(),
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "vendor=1")

	// What Enqueue does with each message's headers:
	h := outbox.InjectHeaders(ctx, outbox.TraceContext, map[string]string{"content-type": "application/json"})
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Printf("%s: %s\n", k, h[k])
	}
	// Output:
	// content-type: application/json
	// traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01
	// tracestate: vendor=1
}

// A Propagator plugs in another tracing library (OpenTelemetry needs none:
// see TraceContext and OTelPropagator).
func ExamplePropagatorFunc() {
	type spanKey struct{}
	p := outbox.PropagatorFunc(func(ctx context.Context, h map[string]string) {
		if span, ok := ctx.Value(spanKey{}).(string); ok {
			h["x-span"] = span
		}
	})
	ctx := context.WithValue(context.Background(), spanKey{}, "span-7")
	fmt.Println(outbox.InjectHeaders(ctx, p, nil))
	// Output:
	// map[x-span:span-7]
}

// nackSecond is a Publisher that confirms every message but the second.
type nackSecond struct{}

func (nackSecond) Publish(_ context.Context, msgs []*outbox.Message) error {
	if len(msgs) < 2 {
		return nil
	}
	return &outbox.PublishError{Failed: map[int]error{1: errors.New("nacked")}}
}

// A publisher reports the messages it could not publish by their index in
// the batch; the relay retries those and marks the others published.
func ExamplePublishError() {
	var p outbox.Publisher = nackSecond{}
	batch := []*outbox.Message{{ID: "a"}, {ID: "b"}, {ID: "c"}}
	err := p.Publish(context.Background(), batch)
	var pe *outbox.PublishError
	if errors.As(err, &pe) {
		for i, m := range batch {
			if cause, failed := pe.Failed[i]; failed {
				fmt.Println(m.ID, "retry:", cause)
			} else {
				fmt.Println(m.ID, "published")
			}
		}
	}
	// Output:
	// a published
	// b retry: nacked
	// c published
}

// With OpenTelemetry the span of the context passed to Enqueue is stored
// with the message and sent as its traceparent: the consumer's span becomes
// its child. No configuration is needed; OTelPropagator picks another
// format (here W3C, what TraceContext writes too).
func ExampleOTelPropagator() {
	tp := sdktrace.NewTracerProvider()
	defer func() { _ = tp.Shutdown(context.Background()) }()
	ctx, span := tp.Tracer("checkout").Start(context.Background(), "place order")
	defer span.End()

	h := outbox.InjectHeaders(ctx, outbox.OTelPropagator(propagation.TraceContext{}), nil)
	sc, ok := outbox.SpanContext(h)
	fmt.Println(ok, sc.TraceID() == span.SpanContext().TraceID(), sc.SpanID() == span.SpanContext().SpanID())
	// Output:
	// true true true
}

// SpanContext reads the trace context a message carries, as a relay or a
// consumer does.
func ExampleSpanContext() {
	sc, ok := outbox.SpanContext(map[string]string{
		outbox.HeaderTraceParent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
	})
	fmt.Println(ok, sc.TraceID(), sc.SpanID(), sc.IsSampled())
	// Output:
	// true 4bf92f3577b34da6a3ce929d0e0e4736 00f067aa0ba902b7 true
}
