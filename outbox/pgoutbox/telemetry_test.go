package pgoutbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// The relay's OpenTelemetry metrics: published, retried and dead counters
// per table and topic, the publish latency by result, the delay of each
// confirmed message, and the backlog gauges.
func TestRelayMetrics(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	ob := newOutbox(t, pool, pgoutbox.Options{Table: "events_out"})
	mp := telemetrytest.NewMetrics(t)

	down := errors.New("broker unreachable")
	pub := &memPublisher{
		down: func() error { return down },
		fail: func(m *outbox.Message) error {
			switch string(m.Payload) {
			case "retry":
				if m.Attempt <= 2 {
					return errBoom
				}
			case "dead":
				return errBoom
			}
			return nil
		},
	}
	ids := enqueue(t, pool, ob,
		msg("orders", "k1", "ok"),
		msg("orders", "k2", "retry"),
		msg("payments", "k3", "dead"),
	)
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{
		Shards:          2,
		MaxAttempts:     3,
		Telemetry:       consumer.Telemetry{MeterProvider: mp},
		MetricsInterval: 20 * time.Millisecond,
	}))
	if err != nil {
		t.Fatal(err)
	}
	rr := start(t, r)

	table := telemetry.AttrTable.String(ob.Options().Schema + ".events_out")
	// The broker is down: the backlog holds the three messages, and the
	// failed batches are recorded as publish errors.
	testenv.Eventually(t, 30*time.Second, "a failed publish and the backlog gauge at 3", func() bool {
		return mp.Sum(telemetry.MetricOutboxPublishDuration, table, telemetry.AttrResult.String("error")) > 0 &&
			gauge(t, mp, telemetry.MetricOutboxBacklog, table) == 3
	})
	if age := gauge(t, mp, telemetry.MetricOutboxOldestAge, table); age <= 0 || age > 60 {
		t.Errorf("%s = %v s, want the age of the oldest message", telemetry.MetricOutboxOldestAge, age)
	}

	pub.mu.Lock()
	pub.down = nil
	pub.mu.Unlock()
	testenv.Eventually(t, 30*time.Second, "two published, one dead", func() bool {
		return countState(t, pool, ob, 1) == 2 && countState(t, pool, ob, 2) == 1
	})
	testenv.Eventually(t, 30*time.Second, "the backlog gauge at 0", func() bool {
		return gauge(t, mp, telemetry.MetricOutboxBacklog, table) == 0
	})

	// The relay counts a batch's messages after its COMMIT, which the
	// database state above may show first: the exact values are checked
	// once they settled.
	orders, payments := telemetry.AttrDestination.String("orders"), telemetry.AttrDestination.String("payments")
	settled(t, 20*time.Second, func() (mismatches []string) {
		for _, c := range []struct {
			metric string
			attrs  []attribute.KeyValue
			want   float64
		}{
			{telemetry.MetricOutboxPublished, []attribute.KeyValue{table, orders}, 2},
			{telemetry.MetricOutboxPublished, []attribute.KeyValue{table, payments}, 0},
			{telemetry.MetricOutboxRetried, []attribute.KeyValue{table, orders}, 2},
			{telemetry.MetricOutboxRetried, []attribute.KeyValue{table, payments}, 2},
			{telemetry.MetricOutboxDead, []attribute.KeyValue{table, payments}, 1},
			{telemetry.MetricOutboxDead, []attribute.KeyValue{table, orders}, 0},
			{telemetry.MetricOutboxDelay, []attribute.KeyValue{table}, 2}, // one per confirmed message
		} {
			if got := mp.Sum(c.metric, c.attrs...); got != c.want {
				mismatches = append(mismatches, fmt.Sprintf("%s%v = %v, want %v", c.metric, c.attrs, got, c.want))
			}
		}
		// Every Publish call is timed: ok only for the batches nothing failed in.
		okBatches := mp.Sum(telemetry.MetricOutboxPublishDuration, table, telemetry.AttrResult.String("ok"))
		errBatches := mp.Sum(telemetry.MetricOutboxPublishDuration, table, telemetry.AttrResult.String("error"))
		if calls := float64(pub.callCount()); okBatches+errBatches != calls || errBatches < 2 {
			mismatches = append(mismatches, fmt.Sprintf("publish duration: %v ok + %v error, want %v calls in all, at least 2 failed", okBatches, errBatches, calls))
		}
		// In all, per table.
		if p, re, d := counts(mp); p != 2 || re != 4 || d != 1 {
			mismatches = append(mismatches, fmt.Sprintf("in all: published %d, retried %d, dead %d; want 2, 4, 1", p, re, d))
		}
		return mismatches
	})
	mp.NoValueContains(append(ids, "k1", "k2", "k3")...)

	// The gauges leave with the relay.
	rr.stop(t)
	if pts := mp.Points(telemetry.MetricOutboxBacklog); len(pts) != 0 {
		t.Errorf("backlog gauge after Run returned: %v", pts)
	}
}

// settled waits, up to timeout, until check finds no mismatch, and fails
// the test with the mismatches of its last run if it never does. For exact
// values that the relay records after the state the test waited for
// became visible.
func settled(t *testing.T, timeout time.Duration, check func() []string) {
	t.Helper()
	var last []string
	defer func() {
		if len(last) > 0 {
			for _, m := range last {
				t.Errorf("after %v: %s", timeout, m)
			}
		}
	}()
	testenv.Eventually(t, timeout, "the exact values", func() bool {
		last = check()
		return len(last) == 0
	})
}

// gauge returns the value of the point of a gauge with attrs, or -1 when
// there is none.
func gauge(t *testing.T, mp *telemetrytest.Metrics, name string, attrs ...attribute.KeyValue) float64 {
	t.Helper()
	for _, p := range mp.Points(name) {
		if telemetrytest.Has(p.Attrs, attrs...) {
			return p.Value
		}
	}
	return -1
}

// The backlog is queried at most about once per MetricsInterval, however
// often the provider collects.
func TestRelayBacklogSampledOncePerInterval(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	mp := telemetrytest.NewMetrics(t)
	r, err := pgoutbox.NewRelay(ob, &memPublisher{}, fastRelay(pgoutbox.RelayOptions{Telemetry: consumer.Telemetry{MeterProvider: mp}, MetricsInterval: time.Hour}))
	if err != nil {
		t.Fatal(err)
	}
	start(t, r)
	table := telemetry.AttrTable.String(ob.Options().Schema + ".outbox")
	testenv.Eventually(t, 10*time.Second, "a backlog sample", func() bool { return gauge(t, mp, telemetry.MetricOutboxBacklog, table) == 0 })
	enqueue(t, pool, ob, msg("t", "", "a"), msg("t", "", "b"))
	testenv.Eventually(t, 30*time.Second, "the messages published", func() bool { return countState(t, pool, ob, 1) == 2 })
	// Published, but the sample is the hour-long interval's first one.
	for range 5 {
		if got := gauge(t, mp, telemetry.MetricOutboxBacklog, table); got != 0 {
			t.Fatalf("backlog = %v, want the cached 0", got)
		}
	}
}

// A span active at Enqueue is the parent of the published message's trace
// context: the traceparent header carries its trace id and span id. The
// relay's "publish <topic>" producer span is a root linked to it.
func TestRelayTraceContext(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	tp := telemetrytest.NewSpans(t)
	pub := &memPublisher{}
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{Telemetry: consumer.Telemetry{TracerProvider: tp}}))
	if err != nil {
		t.Fatal(err)
	}
	start(t, r)

	ctx, span := tp.Tracer("test").Start(context.Background(), "place order")
	enqueueCtx(ctx, t, pool, ob, msg("orders", "order-1", "placed"))
	span.End()
	sc := span.SpanContext()

	testenv.Eventually(t, 30*time.Second, "the message published", func() bool { return len(pub.published()) == 1 })
	h := pub.published()[0].Headers
	want := "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-01"
	if h[outbox.HeaderTraceParent] != want {
		t.Fatalf("traceparent = %q, want %q", h[outbox.HeaderTraceParent], want)
	}
	got, ok := telemetry.HeadersSpanContext(h)
	if !ok || got.TraceID() != sc.TraceID() || got.SpanID() != sc.SpanID() {
		t.Fatalf("published span context %v, want trace %s parent %s", got, sc.TraceID(), sc.SpanID())
	}

	testenv.Eventually(t, 10*time.Second, "the publish span", func() bool { return len(tp.Named("publish orders")) == 1 })
	ps := tp.Named("publish orders")[0]
	if ps.SpanKind() != trace.SpanKindProducer {
		t.Errorf("publish span kind %v, want producer", ps.SpanKind())
	}
	if ps.Parent().IsValid() || ps.SpanContext().TraceID() == sc.TraceID() {
		t.Errorf("publish span: parent %v, trace %s; want a new root", ps.Parent(), ps.SpanContext().TraceID())
	}
	links := ps.Links()
	if len(links) != 1 || links[0].SpanContext.SpanID() != sc.SpanID() || links[0].SpanContext.TraceID() != sc.TraceID() {
		t.Errorf("publish span links %v, want the enqueuing span", links)
	}
	for _, kv := range ps.Attributes() {
		if v := kv.Value.String(); v == "order-1" || v == pub.published()[0].ID {
			t.Errorf("publish span attribute %s holds a key or id", kv.Key)
		}
	}
}

// enqueueCtx is enqueue with the caller's context (its span).
func enqueueCtx(ctx context.Context, t *testing.T, pool *pgxpool.Pool, ob *pgoutbox.Outbox, msgs ...outbox.Message) {
	t.Helper()
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := ob.Enqueue(ctx, tx, msgs...)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}
