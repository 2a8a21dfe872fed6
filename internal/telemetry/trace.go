package telemetry

import (
	"context"
	"reflect"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace/noop"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// DefaultPropagator is W3C Trace Context (traceparent, tracestate): what
// the outbox stores and the adapters read when the user names no
// propagator. Baggage is left out on purpose: OpenTelemetry's baggage
// propagator reports every malformed baggage header it extracts to the
// global error handler (stderr by default), so a hostile producer could
// flood a consumer's logs. Pass propagation.Baggage{} in a composite
// propagator to carry it.
var DefaultPropagator propagation.TextMapPropagator = propagation.TraceContext{}

// MaxHeaderValue bounds a header value a carrier hands to a propagator:
// longer values (a hostile 1 MB traceparent) read as absent.
const MaxHeaderValue = 8 << 10

// StartConsumer starts the span of one delivery: a consumer span named
// "process <destination>" that continues the trace found in carrier
// (its parent is the producer's context, the one present at
// Outbox.Enqueue), with p (nil: DefaultPropagator). end records the verdict
// and ends the span.
func (a *Adapter) StartConsumer(ctx context.Context, p propagation.TextMapPropagator, carrier propagation.TextMapCarrier, destination string) (context.Context, func(result string, err error)) {
	if !Tracing(a.tp) {
		return ctx, noEndConsumer
	}
	if p == nil {
		p = DefaultPropagator
	}
	if carrier != nil {
		ctx = p.Extract(ctx, carrier)
	}
	ctx, span := a.Tracer.Start(ctx, "process "+destination,
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(
			AttrSystem.String(a.system),
			AttrDestination.String(destination),
			AttrOperation.String("process"),
		))
	if !span.IsRecording() {
		return ctx, noEndConsumer
	}
	return ctx, func(result string, err error) {
		span.SetAttributes(AttrResult.String(result))
		if err != nil && result != "ack" {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}

// SpanAttrs is a helper for the claim span's attributes.
func (d *Dedup) SpanAttrs(keyHash string) []attribute.KeyValue {
	return []attribute.KeyValue{AttrScope.String(d.scope), AttrStore.String(d.store), AttrKeyHash.String(keyHash)}
}

func noEndConsumer(string, error) {}

// defaultTracerProvider is the global provider before the application
// installs one: otel.GetTracerProvider returns this delegating provider
// until otel.SetTracerProvider is called, and the installed provider after.
// It is nil when a provider was installed before this package was
// initialised.
var defaultTracerProvider = func() trace.TracerProvider {
	tp := otel.GetTracerProvider()
	if t := reflect.TypeOf(tp); t != nil && t.Kind() == reflect.Pointer && t.Elem().PkgPath() == "go.opentelemetry.io/otel/internal/global" {
		return tp
	}
	return nil
}()

// Tracing reports whether spans from tp may record: false when tp is nil
// and the application installed no global provider, or when tp is
// OpenTelemetry's no-op provider. Adapters then skip the consumer span, and
// with it the header extraction and the allocations it costs on every
// message. It is checked per message, so a provider installed later is
// picked up.
func Tracing(tp trace.TracerProvider) bool {
	switch tp.(type) {
	case nil:
		return otel.GetTracerProvider() != defaultTracerProvider
	case noop.TracerProvider, *noop.TracerProvider:
		return false
	}
	return true
}
