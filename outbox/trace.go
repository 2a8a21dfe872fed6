package outbox

import "context"

// Propagator writes the trace context carried by ctx into a message's
// headers. Enqueue calls it once per message, with ctx the context passed to
// Enqueue, so the relay can send the trace context with the message long
// after the request that produced it ended.
//
// An OpenTelemetry TextMapPropagator fits in one line, since
// propagation.MapCarrier is a map[string]string:
//
//	outbox.PropagatorFunc(func(ctx context.Context, h map[string]string) {
//		otel.GetTextMapPropagator().Inject(ctx, propagation.MapCarrier(h))
//	})
type Propagator interface {
	Inject(ctx context.Context, headers map[string]string)
}

// PropagatorFunc adapts a function to a Propagator.
type PropagatorFunc func(ctx context.Context, headers map[string]string)

// Inject calls f(ctx, headers).
func (f PropagatorFunc) Inject(ctx context.Context, headers map[string]string) { f(ctx, headers) }

type traceKey struct{}

type traceContext struct{ parent, state string }

// WithTraceContext returns a copy of ctx carrying a W3C trace context: the
// traceparent and (optionally empty) tracestate header values. The default
// Propagator (TraceContext) stores them in the headers of the messages
// enqueued with that context. An empty traceparent removes the trace
// context.
func WithTraceContext(ctx context.Context, traceparent, tracestate string) context.Context {
	if traceparent == "" {
		return context.WithValue(ctx, traceKey{}, (*traceContext)(nil))
	}
	return context.WithValue(ctx, traceKey{}, &traceContext{parent: traceparent, state: tracestate})
}

// TraceContextFrom returns the trace context stored by WithTraceContext, and
// whether there is one.
func TraceContextFrom(ctx context.Context) (traceparent, tracestate string, ok bool) {
	tc, _ := ctx.Value(traceKey{}).(*traceContext)
	if tc == nil {
		return "", "", false
	}
	return tc.parent, tc.state, true
}

// TraceContext is the default Propagator: it writes the trace context stored
// by WithTraceContext as the HeaderTraceParent and HeaderTraceState headers
// (the latter only when not empty). It writes nothing when ctx carries no
// trace context.
var TraceContext Propagator = PropagatorFunc(func(ctx context.Context, h map[string]string) {
	parent, state, ok := TraceContextFrom(ctx)
	if !ok {
		return
	}
	h[HeaderTraceParent] = parent
	if state != "" {
		h[HeaderTraceState] = state
	}
})

// InjectHeaders returns headers with the trace context of ctx added by p.
// Headers already present win over the propagated ones, so a message that
// names its own traceparent keeps it. headers is not modified; the result is
// a new map (nil only when there is nothing to carry).
func InjectHeaders(ctx context.Context, p Propagator, headers map[string]string) map[string]string {
	var injected map[string]string
	if p != nil {
		injected = make(map[string]string, 2)
		p.Inject(ctx, injected)
	}
	if len(headers) == 0 && len(injected) == 0 {
		return nil
	}
	out := make(map[string]string, len(headers)+len(injected))
	for k, v := range injected {
		out[k] = v
	}
	for k, v := range headers {
		out[k] = v
	}
	return out
}
