package outbox

import (
	"context"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/telemetry"
)

// Propagator writes the trace context carried by ctx into a message's
// headers. Enqueue calls it once per message, with ctx the context passed to
// Enqueue, so the relay can send the trace context with the message long
// after the request that produced it ended.
//
// The default, TraceContext, writes the OpenTelemetry span of ctx as W3C
// Trace Context; OTelPropagator plugs in any other OpenTelemetry
// propagator, and PropagatorFunc any other tracing library.
type Propagator interface {
	Inject(ctx context.Context, headers map[string]string)
}

// PropagatorFunc adapts a function to a Propagator.
type PropagatorFunc func(ctx context.Context, headers map[string]string)

// Inject calls f(ctx, headers).
func (f PropagatorFunc) Inject(ctx context.Context, headers map[string]string) { f(ctx, headers) }

// OTelPropagator returns a Propagator that writes the OpenTelemetry context
// of ctx (its span context, and its baggage when p carries baggage) with p,
// for example otel.GetTextMapPropagator() or a B3 propagator. A nil p is W3C
// Trace Context, the propagator TraceContext uses.
//
// Unlike TraceContext it does not read WithTraceContext.
func OTelPropagator(p propagation.TextMapPropagator) Propagator {
	if p == nil {
		p = telemetry.DefaultPropagator
	}
	return PropagatorFunc(func(ctx context.Context, h map[string]string) {
		p.Inject(ctx, propagation.MapCarrier(h))
	})
}

type traceKey struct{}

type traceContext struct{ parent, state string }

// WithTraceContext returns a copy of ctx carrying a W3C trace context: the
// traceparent and (optionally empty) tracestate header values, for
// applications that do not use OpenTelemetry. The default Propagator
// (TraceContext) stores them in the headers of the messages enqueued with
// that context when ctx has no OpenTelemetry span.
//
// An empty traceparent removes the trace context: TraceContext then writes
// no trace context at all, not even the OpenTelemetry span's.
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

// TraceContext is the default Propagator. It writes, in this order of
// preference:
//
//   - the OpenTelemetry span context of ctx, when it has a valid one
//     (trace.SpanContextFromContext), as W3C Trace Context
//     (HeaderTraceParent, and HeaderTraceState when not empty). It uses
//     W3C propagation whatever the global propagator
//     (otel.SetTextMapPropagator) is; use OTelPropagator for another
//     format or to carry baggage.
//   - otherwise the trace context stored by WithTraceContext.
//
// It writes nothing when ctx carries neither, or when WithTraceContext
// removed the trace context. The span context is the one of the span
// active at Enqueue time, so the consumer's span that continues it from the
// published headers becomes that span's child.
var TraceContext Propagator = PropagatorFunc(func(ctx context.Context, h map[string]string) {
	if v, set := ctx.Value(traceKey{}).(*traceContext); set && v == nil {
		return // removed by WithTraceContext(ctx, "", ...)
	}
	if trace.SpanContextFromContext(ctx).IsValid() {
		telemetry.DefaultPropagator.Inject(ctx, propagation.MapCarrier(h))
		return
	}
	parent, state, ok := TraceContextFrom(ctx)
	if !ok {
		return
	}
	h[HeaderTraceParent] = parent
	if state != "" {
		h[HeaderTraceState] = state
	}
})

// SpanContext returns the OpenTelemetry span context stored in a message's
// headers (HeaderTraceParent, HeaderTraceState), and whether there is a
// valid one. A relay links its publish span to it; a consumer continues it.
func SpanContext(headers map[string]string) (trace.SpanContext, bool) {
	if headers[HeaderTraceParent] == "" {
		return trace.SpanContext{}, false
	}
	sc := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), limitedCarrier(headers)))
	return sc, sc.IsValid()
}

// limitedCarrier reads a header map, treating values longer than
// telemetry.MaxHeaderValue as absent.
type limitedCarrier map[string]string

func (c limitedCarrier) Get(key string) string {
	if v := c[key]; len(v) <= telemetry.MaxHeaderValue {
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

// InjectHeaders returns headers with the trace context of ctx added by p.
// Headers already present win over the propagated ones, so a message that
// names its own traceparent keeps it (with its own tracestate, if any, and
// never the propagated one). headers is not modified; the result is
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
	_, ownParent := headers[HeaderTraceParent]
	for k, v := range injected {
		if ownParent && k == HeaderTraceState {
			continue // never mix the message's own traceparent with another tracestate
		}
		out[k] = v
	}
	for k, v := range headers {
		out[k] = v
	}
	return out
}
