package walrelay_test

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

// counters is an outbox.Metrics for tests.
type counters struct {
	mu                       sync.Mutex
	published, retried, dead int
	maxBacklog               int64
}

func (c *counters) Published(_ string, n int) { c.mu.Lock(); c.published += n; c.mu.Unlock() }
func (c *counters) Retried(_ string, n int)   { c.mu.Lock(); c.retried += n; c.mu.Unlock() }
func (c *counters) Dead(_ string, n int)      { c.mu.Lock(); c.dead += n; c.mu.Unlock() }
func (c *counters) Backlog(n int64, _ time.Duration) {
	c.mu.Lock()
	c.maxBacklog = max(c.maxBacklog, n)
	c.mu.Unlock()
}

// While the broker is down the slot's lag shows in bytes and seconds; once
// it is back the lag age drops to zero, and the counters (OpenTelemetry and
// the outbox.Metrics hook) count the published, retried and parked
// messages.
func TestRelayMetrics(t *testing.T) {
	pool := logicalPool(t)
	ob := newWAL(t, pool, walrelay.Options{})
	mp := telemetrytest.NewMetrics(t)
	hook := &counters{}
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
		MaxAttempts: 2, MeterProvider: mp, Metrics: hook, MetricsInterval: 10 * time.Millisecond,
	}))
	ids := enqueue(t, pool, ob, msg("orders", "k1", "ok"), msg("orders", "k2", "retry"), msg("payments", "k3", "dead"))

	gauge := func(name string) float64 {
		ps := mp.Points(name)
		if len(ps) != 1 {
			return -1
		}
		if !telemetrytest.Has(ps[0].Attrs, telemetry.AttrTable.String(ob.Options().Schema+".outbox")) {
			t.Fatalf("%s: attributes %v", name, ps[0].Attrs)
		}
		return ps[0].Value
	}
	eventually(t, "the slot's lag in bytes and seconds, and the backlog, while the broker is down", func() bool {
		hook.mu.Lock()
		backlog := hook.maxBacklog
		hook.mu.Unlock()
		return backlog == 3 && gauge(telemetry.MetricSlotLag) > 0 && gauge(telemetry.MetricSlotRetained) > 0 && gauge(telemetry.MetricSlotLagAge) > 0
	})
	pub.setDown(nil)
	pub.waitIDs(t, ids[:2])
	eventually(t, "the poison message parked", func() bool {
		hook.mu.Lock()
		defer hook.mu.Unlock()
		return hook.dead == 1
	})
	if age := gauge(telemetry.MetricSlotLagAge); age != 0 {
		t.Fatalf("lag age %v with everything confirmed", age)
	}
	hook.mu.Lock()
	defer hook.mu.Unlock()
	if hook.published != 2 || hook.retried != 2 || hook.maxBacklog != 3 {
		t.Fatalf("hook: published %d retried %d backlog %d; want 2, 2 (one retry, one before parking), 3",
			hook.published, hook.retried, hook.maxBacklog)
	}
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
