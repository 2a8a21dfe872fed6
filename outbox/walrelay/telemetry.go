package walrelay

import (
	"context"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/outbox/internal/relaycore"
)

// attrSlot names the replication slot on the slot gauges.
const attrSlot = attribute.Key("idem.outbox.slot")

// relayTelemetry is the relay's OpenTelemetry instruments (the ones every
// relay records, and the slot gauges) and the gauge values they report.
type relayTelemetry struct {
	*relaycore.Telemetry
	slotObs []metric.ObserveOption

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
	t := &relayTelemetry{Telemetry: relaycore.NewTelemetry(mp, tp, table,
		"Time from an outbox message's commit to the broker's confirmation.")}
	t.NameEmptyTopic = true
	t.lagBytes.Store(-1)
	t.retainedBytes.Store(-1)
	t.slotObs = []metric.ObserveOption{metric.WithAttributeSet(attribute.NewSet(t.Table, attrSlot.String(slot)))}
	return t
}

// register reports the slot gauges and the backlog gauge on collection.
// The returned function unregisters them.
func (t *relayTelemetry) register() func() {
	lag, err1 := t.Meter.Int64ObservableGauge(telemetry.MetricSlotLag, metric.WithUnit("By"),
		metric.WithDescription("WAL written since the replication slot's confirmed position (what the outbox relay has not confirmed)."))
	retained, err2 := t.Meter.Int64ObservableGauge(telemetry.MetricSlotRetained, metric.WithUnit("By"),
		metric.WithDescription("WAL PostgreSQL keeps for the outbox relay's replication slot."))
	age, err3 := t.Meter.Float64ObservableGauge(telemetry.MetricSlotLagAge, metric.WithUnit("s"),
		metric.WithDescription("Time since the commit of the oldest outbox transaction the relay received and has not confirmed."))
	backlog, err4 := t.Meter.Int64ObservableGauge(telemetry.MetricOutboxBacklog, metric.WithUnit("{message}"),
		metric.WithDescription("Outbox messages the WAL relay received from its slot and has not yet published or parked."))
	for _, err := range []error{err1, err2, err3, err4} {
		if err != nil {
			otel.Handle(err)
			return func() {}
		}
	}
	reg, err := t.Meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
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
