package pgoutbox

import (
	"context"
	"errors"
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

// relayTelemetry is a relay's OpenTelemetry instruments. Attribute sets are
// cached per topic (topics are few; ids never appear).
type relayTelemetry struct {
	tracer    trace.Tracer
	meter     metric.Meter
	table     attribute.KeyValue // idem.outbox.table = schema.table
	published metric.Int64Counter
	retried   metric.Int64Counter
	dead      metric.Int64Counter
	publishD  metric.Float64Histogram
	delay     metric.Float64Histogram
	backlog   metric.Int64ObservableGauge
	oldest    metric.Float64ObservableGauge
	tableObs  []metric.ObserveOption
	tableRec  []metric.RecordOption
	okRec     []metric.RecordOption
	errRec    []metric.RecordOption
	topics    sync.Map // topic -> []metric.AddOption
	ntopics   int64    // entries in topics, under topicsMu
	topicsMu  sync.Mutex
}

// maxTopicSets bounds the cached attribute sets; past it they are built for
// each record (a relay of that many topics has other problems).
const maxTopicSets = 1024

func newRelayTelemetry(mp metric.MeterProvider, tp trace.TracerProvider, table string) *relayTelemetry {
	m := telemetry.Meter(mp)
	t := &relayTelemetry{
		tracer:    telemetry.Tracer(tp),
		meter:     m,
		table:     telemetry.AttrTable.String(table),
		published: telemetry.Counter(m, telemetry.MetricOutboxPublished, "{message}", "Outbox messages the broker confirmed and the relay marked published."),
		retried:   telemetry.Counter(m, telemetry.MetricOutboxRetried, "{message}", "Failed publish attempts of outbox messages that will be retried after a backoff."),
		dead:      telemetry.Counter(m, telemetry.MetricOutboxDead, "{message}", "Outbox messages parked as dead after their last attempt."),
		publishD:  telemetry.Histogram(m, telemetry.MetricOutboxPublishDuration, "Time the relay's publisher took to confirm (or fail) one batch."),
		delay:     telemetry.Histogram(m, telemetry.MetricOutboxDelay, "Time from an outbox row becoming available (its commit, or its retry being due) to the broker's confirmation."),
	}
	var err error
	t.backlog, err = m.Int64ObservableGauge(telemetry.MetricOutboxBacklog, metric.WithUnit("{message}"),
		metric.WithDescription("Outbox messages not yet published (pending, not dead), sampled at most once per MetricsInterval."))
	if err != nil {
		otel.Handle(err)
	}
	t.oldest, err = m.Float64ObservableGauge(telemetry.MetricOutboxOldestAge, metric.WithUnit("s"),
		metric.WithDescription("Age of the oldest unpublished outbox message (database clock), sampled at most once per MetricsInterval."))
	if err != nil {
		otel.Handle(err)
	}
	// Option slices built once: passing them with ... allocates nothing.
	tableSet := metric.WithAttributeSet(attribute.NewSet(t.table))
	t.tableObs = []metric.ObserveOption{tableSet}
	t.tableRec = []metric.RecordOption{tableSet}
	t.okRec = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(t.table, telemetry.AttrResult.String("ok")))}
	t.errRec = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(t.table, telemetry.AttrResult.String("error")))}
	return t
}

// topicOpt is the attribute set {table, destination = topic}.
func (t *relayTelemetry) topicOpt(topic string) []metric.AddOption {
	if v, ok := t.topics.Load(topic); ok {
		return v.([]metric.AddOption)
	}
	o := []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(t.table, telemetry.AttrDestination.String(topic)))}
	t.topicsMu.Lock()
	defer t.topicsMu.Unlock()
	if t.ntopics < maxTopicSets {
		if _, loaded := t.topics.LoadOrStore(topic, o); !loaded {
			t.ntopics++
		}
	}
	return o
}

// counted records the counters of one marked batch.
func (t *relayTelemetry) counted(ctx context.Context, published, retried, dead map[string]int) {
	for topic, n := range published {
		t.published.Add(ctx, int64(n), t.topicOpt(topic)...)
	}
	for topic, n := range retried {
		t.retried.Add(ctx, int64(n), t.topicOpt(topic)...)
	}
	for topic, n := range dead {
		t.dead.Add(ctx, int64(n), t.topicOpt(topic)...)
	}
}

// publishedBatch records a batch's Publish call: its duration, and the delay of
// each confirmed message (ages[i] is message i's age at the claim, by the
// database clock, plus the time since the claim).
func (t *relayTelemetry) publishedBatch(ctx context.Context, took time.Duration, err error, sinceClaim time.Duration, ages []time.Duration, confirmed func(i int) bool) {
	if err == nil {
		t.publishD.Record(ctx, took.Seconds(), t.okRec...)
	} else {
		t.publishD.Record(ctx, took.Seconds(), t.errRec...)
	}
	for i, age := range ages {
		if confirmed(i) {
			t.delay.Record(ctx, max(age+sinceClaim, 0).Seconds(), t.tableRec...)
		}
	}
}

// startPublish starts the producer span of one batch: "publish <topic>"
// (or "publish" when the batch spans several topics), a root span linked
// to the trace context each message carries from Enqueue. The messages'
// own headers are left alone: their traceparent stays the one of Enqueue,
// so the consumer's span is the enqueuing span's child, not the relay's.
func (t *relayTelemetry) startPublish(ctx context.Context, msgs []*outbox.Message) (context.Context, func(err error)) {
	topic := msgs[0].Topic
	for _, m := range msgs[1:] {
		if m.Topic != topic {
			topic = ""
			break
		}
	}
	name := "publish"
	attrs := []attribute.KeyValue{
		t.table,
		telemetry.AttrOperation.String("publish"),
		attribute.Int("messaging.batch.message_count", len(msgs)),
	}
	if topic != "" {
		name += " " + topic
		attrs = append(attrs, telemetry.AttrDestination.String(topic))
	}
	ctx, span := t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindProducer),
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

// backlogCache holds the last backlog sample so that collections do not
// query more often than about once per MetricsInterval.
type backlogCache struct {
	mu   sync.Mutex // one query at a time
	last atomic.Pointer[backlogValue]
}

type backlogValue struct {
	at      time.Time // when its query started
	err     error
	pending int64
	oldest  time.Duration
}

// errBacklogBusy answers a collection that finds a backlog query running
// and no sample yet.
var errBacklogBusy = errors.New("pgoutbox: a backlog query is running")

// backlogSample returns the cached sample when it is younger than 90% of
// MetricsInterval, else queries the database (one query at a time). It
// never waits for a query another collection runs: it answers the last
// good sample instead, so a slow database cannot stall a scrape. An error
// caused by ctx ending is not cached.
func (r *Relay) backlogSample(ctx context.Context) (int64, time.Duration, error) {
	c := &r.backlog
	fresh := func(v *backlogValue) bool {
		return v != nil && time.Since(v.at) < r.opts.MetricsInterval*9/10
	}
	if v := c.last.Load(); fresh(v) {
		return v.pending, v.oldest, v.err
	}
	if !c.mu.TryLock() {
		if v := c.last.Load(); v != nil && v.err == nil {
			return v.pending, v.oldest, nil
		}
		return 0, 0, errBacklogBusy
	}
	defer c.mu.Unlock()
	if v := c.last.Load(); fresh(v) {
		return v.pending, v.oldest, v.err
	}
	v := &backlogValue{at: time.Now()}
	qctx, cancel := context.WithTimeout(ctx, r.opts.QueryTimeout)
	defer cancel()
	v.pending, v.oldest, v.err = r.ob.Backlog(qctx)
	if v.err != nil && ctx.Err() != nil {
		return 0, 0, v.err
	}
	c.last.Store(v)
	if v.err != nil {
		r.opts.Logger.Warn("pgoutbox: backlog sample failed", "table", r.ob.table, "err", v.err)
	}
	return v.pending, v.oldest, v.err
}

// collectTimeout bounds the backlog query of a metrics collection (a
// Prometheus scrape), shorter than QueryTimeout's default.
const collectTimeout = 5 * time.Second

// registerBacklog reports the backlog gauges on collection, from
// backlogSample. The returned function unregisters them.
func (r *Relay) registerBacklog() func() {
	t := r.tel
	reg, err := t.meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		ctx, cancel := context.WithTimeout(ctx, min(collectTimeout, r.opts.QueryTimeout))
		defer cancel()
		n, age, err := r.backlogSample(ctx)
		if err != nil {
			return nil // logged; a gauge without a value beats a wrong one
		}
		o.ObserveInt64(t.backlog, n, t.tableObs...)
		o.ObserveFloat64(t.oldest, age.Seconds(), t.tableObs...)
		return nil
	}, t.backlog, t.oldest)
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
