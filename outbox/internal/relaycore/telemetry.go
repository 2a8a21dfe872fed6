package relaycore

import (
	"context"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/outbox"
)

// Telemetry is the OpenTelemetry instruments every relay records: the
// published, retried and dead counters per table and topic, the duration
// of each Publish call by result, and the delay of each confirmed message.
// Attribute sets are cached per topic (topics are few; ids never appear).
// A relay adds its own gauges on Meter.
type Telemetry struct {
	Tracer trace.Tracer
	Meter  metric.Meter
	// Table is idem.outbox.table = schema.table.
	Table attribute.KeyValue
	// Published, Retried and Dead count messages per topic (see Count).
	Published, Retried, Dead metric.Int64Counter
	// NameEmptyTopic names the span of a batch whose messages all have
	// the empty topic "publish " with an empty destination attribute (the
	// WAL relay's spans); when false such a batch is named "publish",
	// like one of several topics.
	NameEmptyTopic bool

	publishD metric.Float64Histogram
	delay    metric.Float64Histogram
	tableRec []metric.RecordOption
	okRec    []metric.RecordOption
	errRec   []metric.RecordOption
	topics   sync.Map // topic -> []metric.AddOption
	ntopics  int64    // entries in topics, under topicsMu
	topicsMu sync.Mutex
}

// maxTopicSets bounds the cached attribute sets; past it they are built for
// each record (a relay of that many topics has other problems).
const maxTopicSets = 1024

// NewTelemetry returns the instruments of a relay of the outbox table (as
// schema.table) from mp and tp; delayDesc describes the delay histogram,
// whose starting point differs between relays.
func NewTelemetry(mp metric.MeterProvider, tp trace.TracerProvider, table, delayDesc string) *Telemetry {
	m := telemetry.Meter(mp)
	t := &Telemetry{
		Tracer:    telemetry.Tracer(tp),
		Meter:     m,
		Table:     telemetry.AttrTable.String(table),
		Published: telemetry.Counter(m, telemetry.MetricOutboxPublished, "{message}", "Outbox messages the broker confirmed and the relay marked published."),
		Retried:   telemetry.Counter(m, telemetry.MetricOutboxRetried, "{message}", "Failed publish attempts of outbox messages that will be retried after a backoff."),
		Dead:      telemetry.Counter(m, telemetry.MetricOutboxDead, "{message}", "Outbox messages parked as dead after their last attempt."),
		publishD:  telemetry.Histogram(m, telemetry.MetricOutboxPublishDuration, "Time the relay's publisher took to confirm (or fail) one batch."),
		delay:     telemetry.Histogram(m, telemetry.MetricOutboxDelay, delayDesc),
	}
	// Option slices built once: passing them with ... allocates nothing.
	t.tableRec = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(t.Table))}
	t.okRec = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(t.Table, telemetry.AttrResult.String("ok")))}
	t.errRec = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(t.Table, telemetry.AttrResult.String("error")))}
	return t
}

// topicOpt is the attribute set {table, destination = topic}.
func (t *Telemetry) topicOpt(topic string) []metric.AddOption {
	if v, ok := t.topics.Load(topic); ok {
		return v.([]metric.AddOption)
	}
	o := []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(t.Table, telemetry.AttrDestination.String(topic)))}
	t.topicsMu.Lock()
	defer t.topicsMu.Unlock()
	if t.ntopics < maxTopicSets {
		if _, loaded := t.topics.LoadOrStore(topic, o); !loaded {
			t.ntopics++
		}
	}
	return o
}

// Count adds each topic's count to c (Published, Retried or Dead).
func (t *Telemetry) Count(ctx context.Context, c metric.Int64Counter, counts map[string]int) {
	for topic, n := range counts {
		c.Add(ctx, int64(n), t.topicOpt(topic)...)
	}
}

// RecordPublish records the duration of one Publish call, by whether it
// returned an error (of the whole batch or of some messages).
func (t *Telemetry) RecordPublish(ctx context.Context, took time.Duration, err error) {
	if err == nil {
		t.publishD.Record(ctx, took.Seconds(), t.okRec...)
	} else {
		t.publishD.Record(ctx, took.Seconds(), t.errRec...)
	}
}

// RecordDelay records the delay of one confirmed message (a negative one,
// from clocks apart, as 0).
func (t *Telemetry) RecordDelay(ctx context.Context, d time.Duration) {
	t.delay.Record(ctx, max(d, 0).Seconds(), t.tableRec...)
}

// StartPublish starts the producer span of one batch: "publish <topic>"
// (or "publish" when the batch spans several topics), a root span linked
// to the trace context each message carries from Enqueue. The messages'
// own headers are left alone: their traceparent stays the one of Enqueue,
// so the consumer's span is the enqueuing span's child, not the relay's.
func (t *Telemetry) StartPublish(ctx context.Context, msgs []*outbox.Message) (context.Context, func(err error)) {
	topic, one := msgs[0].Topic, true
	for _, m := range msgs[1:] {
		if m.Topic != topic {
			one = false
			break
		}
	}
	name := "publish"
	attrs := []attribute.KeyValue{
		t.Table,
		telemetry.AttrOperation.String("publish"),
		attribute.Int("messaging.batch.message_count", len(msgs)),
	}
	if one && (topic != "" || t.NameEmptyTopic) {
		name += " " + topic
		attrs = append(attrs, telemetry.AttrDestination.String(topic))
	}
	ctx, span := t.Tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithNewRoot(), trace.WithAttributes(attrs...))
	if !span.IsRecording() {
		return ctx, func(error) {}
	}
	for _, m := range msgs {
		if sc, ok := telemetry.HeadersSpanContext(m.Headers); ok {
			span.AddLink(trace.Link{SpanContext: sc})
		}
	}
	return ctx, func(err error) {
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}
