package telemetry

import (
	"context"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Adapter is the instrument set of a broker adapter (kafka, rabbitmq,
// watermill, http): the verdict on each message and the time it took.
type Adapter struct {
	Tracer  trace.Tracer
	tp      trace.TracerProvider // as given: nil means the global
	system  string
	msgs    metric.Int64Counter
	process metric.Float64Histogram
	sets    sync.Map // setKey -> metric.MeasurementOption
}

type setKey struct{ dest, result, reason string }

// NewAdapter creates the instruments for a messaging system (kafka,
// rabbitmq, ...) on mp and tp (nil: the globals).
func NewAdapter(mp metric.MeterProvider, tp trace.TracerProvider, system string) *Adapter {
	m := Meter(mp)
	return &Adapter{
		Tracer:  Tracer(tp),
		tp:      tp,
		system:  system,
		msgs:    Counter(m, MetricMessages, "{message}", "Messages handled by an adapter, by result (ack, retry, dead_letter)."),
		process: Histogram(m, MetricProcessDuration, "Time an adapter spent on one message, from delivery to its verdict."),
	}
}

// System is the messaging.system value.
func (a *Adapter) System() string { return a.system }

// Timed reports whether messaging.process.duration records anything for
// ctx: adapters read the clock for it only then.
func (a *Adapter) Timed(ctx context.Context) bool { return a.process.Enabled(ctx) }

// Result records one message's verdict: result is ack, retry or
// dead_letter; reason is the dead-letter reason (empty otherwise). The
// attribute sets are cached per destination, result and reason, all of
// them bounded (topics and queues, not ids).
func (a *Adapter) Result(ctx context.Context, destination, result, reason string, took time.Duration) {
	if !a.msgs.Enabled(ctx) && !a.process.Enabled(ctx) {
		return // no provider records them: skip the attribute set lookup
	}
	k := setKey{destination, result, reason}
	v, ok := a.sets.Load(k)
	if !ok {
		attrs := []attribute.KeyValue{
			AttrSystem.String(a.system), AttrDestination.String(destination),
			AttrOperation.String("process"), AttrResult.String(result),
		}
		if reason != "" {
			attrs = append(attrs, AttrReason.String(reason))
		}
		set := metric.WithAttributeSet(attribute.NewSet(attrs...))
		v, _ = a.sets.LoadOrStore(k, &optSet{add: []metric.AddOption{set}, rec: []metric.RecordOption{set}})
	}
	o := v.(*optSet)
	a.msgs.Add(ctx, 1, o.add...)
	a.process.Record(ctx, took.Seconds(), o.rec...)
}

// optSet holds the option slices of one attribute set, built once so a
// record allocates nothing.
type optSet struct {
	add []metric.AddOption
	rec []metric.RecordOption
}

// LeaseWait is the histogram of time spent waiting on a key another owner
// holds.
type LeaseWait struct {
	h    metric.Float64Histogram
	sets sync.Map
}

// NewLeaseWait creates it on mp (nil: the global provider).
func NewLeaseWait(mp metric.MeterProvider) *LeaseWait {
	return &LeaseWait{h: Histogram(Meter(mp), MetricLeaseWait, "Time spent waiting because another owner held the key.")}
}

// Record records one wait; outcome says how it ended (acquired, duplicate,
// gave_up, ...).
func (w *LeaseWait) Record(ctx context.Context, scope, outcome string, took time.Duration) {
	k := setKey{scope, outcome, ""}
	v, ok := w.sets.Load(k)
	if !ok {
		attrs := []attribute.KeyValue{AttrWaitOutcome.String(outcome)}
		if scope != "" {
			attrs = append(attrs, AttrScope.String(scope))
		}
		set := metric.WithAttributeSet(attribute.NewSet(attrs...))
		v, _ = w.sets.LoadOrStore(k, &optSet{rec: []metric.RecordOption{set}})
	}
	w.h.Record(ctx, took.Seconds(), v.(*optSet).rec...)
}
