package idemkafka

import (
	"cmp"
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/telemetry"
)

// system is the messaging.system attribute of the Consumer's metrics and
// spans.
const system = "kafka"

// Span attributes of OpenTelemetry's messaging conventions, set only on
// recording spans.
const (
	attrPartition  = attribute.Key("messaging.destination.partition.id")
	attrOffset     = attribute.Key("messaging.kafka.offset")
	attrGroup      = attribute.Key("messaging.consumer.group.name")
	attrBatchCount = attribute.Key("messaging.batch.message_count")
)

// The idem.result values of the Consumer's verdicts.
const (
	resultAck        = "ack"
	resultRetry      = "retry"
	resultDeadLetter = "dead_letter"
)

// attemptTel is the telemetry of one handler run: when it started and how
// to end its span.
type attemptTel struct {
	start time.Time
	end   func(result string, err error)
}

func noEnd(string, error) {}

// startAttempt starts the consumer span of one handler run on it,
// continuing the trace in the record's headers; the handler chain runs in
// the returned context.
func (p *partition) startAttempt(ctx context.Context, it *item) (context.Context, attemptTel) {
	var start time.Time
	if p.c.tel.Timed(ctx) {
		start = time.Now()
	}
	ctx, end := p.c.tel.StartConsumer(ctx, p.c.opts.Propagator, (*HeaderCarrier)(&it.km.Headers), it.km.Topic)
	if sp := trace.SpanFromContext(ctx); sp.IsRecording() {
		sp.SetAttributes(attrPartition.String(p.partStr), attrOffset.Int64(it.km.Offset), attrGroup.String(p.c.group))
	}
	return ctx, attemptTel{start: start, end: end}
}

// startBatch starts the span of one BatchHandler call: a consumer span with
// a link to the trace of each record (a batch has no single parent).
func (p *partition) startBatch(ctx context.Context, items []*item) (context.Context, attemptTel) {
	start := time.Now()
	if !telemetry.Tracing(p.c.opts.TracerProvider) {
		return ctx, attemptTel{start: start, end: noEnd}
	}
	ctx, span := p.c.tel.Tracer.Start(ctx, "process "+p.topic,
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(
			telemetry.AttrSystem.String(system),
			telemetry.AttrDestination.String(p.topic),
			telemetry.AttrOperation.String("process"),
			attrPartition.String(p.partStr),
			attrGroup.String(p.c.group),
			attrBatchCount.Int(len(items)),
		))
	if !span.IsRecording() {
		return ctx, attemptTel{start: start, end: noEnd}
	}
	for _, it := range items {
		lctx := p.c.opts.Propagator.Extract(context.Background(), (*HeaderCarrier)(&it.km.Headers))
		if sc := trace.SpanContextFromContext(lctx); sc.IsValid() {
			span.AddLink(trace.Link{SpanContext: sc})
		}
	}
	return ctx, attemptTel{start: start, end: func(result string, err error) {
		if result != "" {
			span.SetAttributes(telemetry.AttrResult.String(result))
		}
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}}
}

// verdict records how a handler run on a record of topic ended and ends
// its span. parked says whether a dead letter is safely in the
// dead-letter topic: one that is not (the Consumer stopped first) comes
// back, so it counts as a retry.
func (c *Consumer) verdict(ctx context.Context, topic string, at attemptTel, r consumer.Result, parked bool) {
	result, reason := verdictOf(r, parked)
	var took time.Duration
	if !at.start.IsZero() {
		took = time.Since(at.start)
	}
	c.tel.Result(ctx, topic, result, reason, took)
	at.end(result, r.Err)
}

// verdictOf is the idem.result and idem.reason of r.
func verdictOf(r consumer.Result, parked bool) (result, reason string) {
	switch {
	case r.Action == consumer.ActionAck && r.DeadLettered:
		// A consumer.DeadLetter middleware parked it.
		return resultDeadLetter, string(r.Reason)
	case r.Action == consumer.ActionAck:
		return resultAck, ""
	case r.Action == consumer.ActionDeadLetter && parked:
		return resultDeadLetter, string(cmp.Or(r.Reason, consumer.OutcomePermanent))
	}
	return resultRetry, ""
}
