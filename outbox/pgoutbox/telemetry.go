package pgoutbox

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/outbox/internal/relaycore"
)

// relayTelemetry is the relay's OpenTelemetry instruments: the ones every
// relay records, and the backlog gauges.
type relayTelemetry struct {
	*relaycore.Telemetry
	backlog  metric.Int64ObservableGauge
	oldest   metric.Float64ObservableGauge
	tableObs []metric.ObserveOption
}

func newRelayTelemetry(mp metric.MeterProvider, tp trace.TracerProvider, table string) *relayTelemetry {
	t := &relayTelemetry{Telemetry: relaycore.NewTelemetry(mp, tp, table,
		"Time from an outbox row becoming available (its commit, or its retry being due) to the broker's confirmation.")}
	var err error
	t.backlog, err = t.Meter.Int64ObservableGauge(telemetry.MetricOutboxBacklog, metric.WithUnit("{message}"),
		metric.WithDescription("Outbox messages not yet published (pending, not dead), sampled at most once per MetricsInterval."))
	if err != nil {
		otel.Handle(err)
	}
	t.oldest, err = t.Meter.Float64ObservableGauge(telemetry.MetricOutboxOldestAge, metric.WithUnit("s"),
		metric.WithDescription("Age of the oldest unpublished outbox message (database clock), sampled at most once per MetricsInterval."))
	if err != nil {
		otel.Handle(err)
	}
	t.tableObs = []metric.ObserveOption{metric.WithAttributeSet(attribute.NewSet(t.Table))}
	return t
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
	reg, err := t.Meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
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
