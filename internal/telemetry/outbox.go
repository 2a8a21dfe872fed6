package telemetry

import (
	"context"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// The W3C Trace Context header names an outbox message carries (the same
// values as outbox.HeaderTraceParent and outbox.HeaderTraceState).
const (
	headerTraceParent = "traceparent"
	headerTraceState  = "tracestate"
)

// InjectHeaders returns headers with the trace context of ctx added by p
// (nil: DefaultPropagator), as an outbox's Enqueue stores it. Headers
// already present win over the propagated ones, so a message that names its
// own traceparent keeps it (with its own tracestate, if any, and never the
// propagated one). headers is not modified; the result is a new map (nil
// only when there is nothing to carry).
func InjectHeaders(ctx context.Context, p propagation.TextMapPropagator, headers map[string]string) map[string]string {
	if p == nil {
		p = DefaultPropagator
	}
	injected := make(propagation.MapCarrier, 2)
	p.Inject(ctx, injected)
	if len(headers) == 0 && len(injected) == 0 {
		return nil
	}
	out := make(map[string]string, len(headers)+len(injected))
	_, ownParent := headers[headerTraceParent]
	for k, v := range injected {
		if ownParent && k == headerTraceState {
			continue // never mix the message's own traceparent with another tracestate
		}
		out[k] = v
	}
	for k, v := range headers {
		out[k] = v
	}
	return out
}

// HeadersSpanContext returns the span context stored in an outbox
// message's headers (W3C traceparent and tracestate), and whether there is
// a valid one: a relay links its publish span to it. Values longer than
// MaxHeaderValue read as absent.
func HeadersSpanContext(headers map[string]string) (trace.SpanContext, bool) {
	if headers[headerTraceParent] == "" {
		return trace.SpanContext{}, false
	}
	sc := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), limitedCarrier(headers)))
	return sc, sc.IsValid()
}

// limitedCarrier reads a header map, treating values longer than
// MaxHeaderValue as absent.
type limitedCarrier map[string]string

func (c limitedCarrier) Get(key string) string {
	if v := c[key]; len(v) <= MaxHeaderValue {
		return v
	}
	return ""
}

func (c limitedCarrier) Set(string, string) {}

func (c limitedCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}
