package walrelay

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/outbox"
)

// attrSlot names the replication slot on the slot gauges.
const attrSlot = attribute.Key("idem.outbox.slot")

// relayTelemetry is a relay's OpenTelemetry instruments and the gauge
// values they report.
type relayTelemetry struct {
	tracer    trace.Tracer
	meter     metric.Meter
	table     attribute.KeyValue
	published metric.Int64Counter
	retried   metric.Int64Counter
	dead      metric.Int64Counter
	publishD  metric.Float64Histogram
	delay     metric.Float64Histogram
	okRec     []metric.RecordOption
	errRec    []metric.RecordOption
	tableRec  []metric.RecordOption
	slotObs   []metric.ObserveOption
	topics    sync.Map     // topic -> []metric.AddOption
	ntopics   atomic.Int64 // entries in topics, at most maxTopicSets

	// Gauge values: -1 until the first sample.
	lagBytes, retainedBytes atomic.Int64
	// oldestNanos is the local time (UnixNano) of the commit of the
	// oldest unconfirmed transaction, 0 when none.
	oldestNanos atomic.Int64
	// pending is the number of received messages not yet published or
	// parked.
	pending atomic.Int64
}

func newRelayTelemetry(mp metric.MeterProvider, tp trace.TracerProvider, table, slot string) *relayTelemetry {
	m := telemetry.Meter(mp)
	t := &relayTelemetry{
		tracer:    telemetry.Tracer(tp),
		meter:     m,
		table:     telemetry.AttrTable.String(table),
		published: telemetry.Counter(m, telemetry.MetricOutboxPublished, "{message}", "Outbox messages the broker confirmed and the relay marked published."),
		retried:   telemetry.Counter(m, telemetry.MetricOutboxRetried, "{message}", "Failed publish attempts of outbox messages that will be retried after a backoff."),
		dead:      telemetry.Counter(m, telemetry.MetricOutboxDead, "{message}", "Outbox messages parked as dead after their last attempt."),
		publishD:  telemetry.Histogram(m, telemetry.MetricOutboxPublishDuration, "Time the relay's publisher took to confirm (or fail) one batch."),
		delay:     telemetry.Histogram(m, telemetry.MetricOutboxDelay, "Time from an outbox message's commit to the broker's confirmation."),
	}
	t.lagBytes.Store(-1)
	t.retainedBytes.Store(-1)
	t.okRec = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(t.table, telemetry.AttrResult.String("ok")))}
	t.errRec = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(t.table, telemetry.AttrResult.String("error")))}
	t.tableRec = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(t.table))}
	t.slotObs = []metric.ObserveOption{metric.WithAttributeSet(attribute.NewSet(t.table, attrSlot.String(slot)))}
	return t
}

// register reports the slot gauges and the backlog gauge on collection.
// The returned function unregisters them.
func (t *relayTelemetry) register() func() {
	lag, err1 := t.meter.Int64ObservableGauge(telemetry.MetricSlotLag, metric.WithUnit("By"),
		metric.WithDescription("WAL written since the replication slot's confirmed position (what the outbox relay has not confirmed)."))
	retained, err2 := t.meter.Int64ObservableGauge(telemetry.MetricSlotRetained, metric.WithUnit("By"),
		metric.WithDescription("WAL PostgreSQL keeps for the outbox relay's replication slot."))
	age, err3 := t.meter.Float64ObservableGauge(telemetry.MetricSlotLagAge, metric.WithUnit("s"),
		metric.WithDescription("Time since the commit of the oldest outbox transaction the relay received and has not confirmed."))
	backlog, err4 := t.meter.Int64ObservableGauge(telemetry.MetricOutboxBacklog, metric.WithUnit("{message}"),
		metric.WithDescription("Outbox messages the WAL relay received from its slot and has not yet published or parked."))
	for _, err := range []error{err1, err2, err3, err4} {
		if err != nil {
			otel.Handle(err)
			return func() {}
		}
	}
	reg, err := t.meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		if v := t.lagBytes.Load(); v >= 0 {
			o.ObserveInt64(lag, v, t.slotObs...)
		}
		if v := t.retainedBytes.Load(); v >= 0 {
			o.ObserveInt64(retained, v, t.slotObs...)
		}
		o.ObserveFloat64(age, t.lagAge().Seconds(), t.slotObs...)
		o.ObserveInt64(backlog, t.pending.Load(), t.slotObs...)
		return nil
	}, lag, retained, age, backlog)
	if err != nil {
		otel.Handle(err)
		return func() {}
	}
	return func() {
		if err := reg.Unregister(); err != nil {
			otel.Handle(err)
		}
	}
}

// lagAge is the age of the oldest unconfirmed transaction, 0 when none.
func (t *relayTelemetry) lagAge() time.Duration {
	n := t.oldestNanos.Load()
	if n == 0 {
		return 0
	}
	return max(time.Since(time.Unix(0, n)), 0)
}

func (t *relayTelemetry) topicOpt(topic string) []metric.AddOption {
	if v, ok := t.topics.Load(topic); ok {
		return v.([]metric.AddOption)
	}
	o := []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(t.table, telemetry.AttrDestination.String(topic)))}
	if t.ntopics.Add(1) <= maxTopicSets {
		t.topics.Store(topic, o)
	}
	return o
}

// maxTopicSets bounds the cached attribute sets; past it they are built
// for each record.
const maxTopicSets = 1024

// count adds each topic's count to c.
func (t *relayTelemetry) count(ctx context.Context, c metric.Int64Counter, counts map[string]int) {
	for topic, n := range counts {
		c.Add(ctx, int64(n), t.topicOpt(topic)...)
	}
}

// startPublish starts the producer span of one batch, "publish <topic>"
// (or "publish" for several topics): a root span linked to the trace
// context each message carries from Enqueue, whose headers stay as they
// are.
func (t *relayTelemetry) startPublish(ctx context.Context, msgs []*outbox.Message) (context.Context, func(err error)) {
	name, attrs := "publish", []attribute.KeyValue{
		t.table, telemetry.AttrOperation.String("publish"), attribute.Int("messaging.batch.message_count", len(msgs)),
	}
	if topic := msgs[0].Topic; allTopic(msgs, topic) {
		name += " " + topic
		attrs = append(attrs, telemetry.AttrDestination.String(topic))
	}
	ctx, span := t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindProducer), trace.WithNewRoot(), trace.WithAttributes(attrs...))
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

func allTopic(msgs []*outbox.Message, topic string) bool {
	for _, m := range msgs {
		if m.Topic != topic {
			return false
		}
	}
	return true
}
