package walrelay_test

import (
	"errors"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

// While the broker is down the slot's lag shows in bytes and seconds and
// the backlog holds the received messages; once it is back the lag age and
// the backlog drop to zero, and the counters count the published, retried
// and parked messages.
func TestRelayMetrics(t *testing.T) {
	t.Parallel()
	pool := logicalPool(t)
	ob := newWAL(t, pool, walrelay.Options{})
	mp := telemetrytest.NewMetrics(t)
	pub := newMemPublisher()
	pub.setDown(func() error { return errors.New("broker unreachable") })
	pub.setFail(func(m *outbox.Message) error {
		switch string(m.Payload) {
		case "retry":
			if m.Attempt == 1 {
				return errBoom
			}
		case "dead":
			return errBoom
		}
		return nil
	})
	start(t, newRelay(t, ob, pub, walrelay.RelayOptions{
		MaxAttempts: 2, Telemetry: consumer.Telemetry{MeterProvider: mp}, MetricsInterval: 10 * time.Millisecond,
	}))
	ids := enqueue(t, pool, ob, msg("orders", "k1", "ok"), msg("orders", "k2", "retry"), msg("payments", "k3", "dead"))

	gauge := func(name string) float64 {
		ps := mp.Points(name)
		if len(ps) != 1 {
			return -1
		}
		if !telemetrytest.Has(ps[0].Attrs, telemetry.AttrTable.String(ob.Options().Schema+".outbox"), attribute.String("idem.outbox.slot", ob.Options().Slot)) {
			t.Fatalf("%s: attributes %v", name, ps[0].Attrs)
		}
		return ps[0].Value
	}
	eventually(t, "the slot's lag in bytes and seconds, and the backlog, while the broker is down", func() bool {
		return gauge(telemetry.MetricOutboxBacklog) == 3 && gauge(telemetry.MetricSlotLag) > 0 && gauge(telemetry.MetricSlotRetained) > 0 && gauge(telemetry.MetricSlotLagAge) > 0
	})
	pub.setDown(nil)
	pub.waitIDs(t, ids[:2])
	eventually(t, "the poison message parked", func() bool {
		return mp.Sum(telemetry.MetricOutboxDead) == 1
	})
	if age := gauge(telemetry.MetricSlotLagAge); age != 0 {
		t.Fatalf("lag age %v with everything confirmed", age)
	}
	if n := gauge(telemetry.MetricOutboxBacklog); n != 0 {
		t.Fatalf("backlog %v with everything published or parked", n)
	}
	// Published 2, retried 2 (one retry, one attempt before parking),
	// parked 1.
	for name, want := range map[string]float64{
		telemetry.MetricOutboxPublished: 2, telemetry.MetricOutboxRetried: 2, telemetry.MetricOutboxDead: 1,
	} {
		if got := mp.Sum(name); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	if mp.Sum(telemetry.MetricOutboxDelay) != 2 || mp.Sum(telemetry.MetricOutboxPublishDuration) == 0 {
		t.Errorf("delay points %v (want 2), publish duration points %v",
			mp.Sum(telemetry.MetricOutboxDelay), mp.Sum(telemetry.MetricOutboxPublishDuration))
	}
}
