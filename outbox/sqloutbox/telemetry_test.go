package sqloutbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/sqloutbox"
)

// The relay's OpenTelemetry metrics and spans, on SQLite: the published,
// retried and dead counters per table and topic, counted once the marks
// committed, the publish duration by result, and a producer span per
// batch.
func TestRelayTelemetry(t *testing.T) {
	db := sqliteDB(t)
	ob := newOutbox(t, db, sqloutbox.SQLite, sqloutbox.Options{Table: "events_out"})
	mp := telemetrytest.NewMetrics(t)
	spans := telemetrytest.NewSpans(t)
	errBoom := errors.New("rejected")
	pub := &memPublisher{fail: func(m *outbox.Message) error {
		switch string(m.Payload) {
		case "retry":
			if m.Attempt <= 2 {
				return errBoom
			}
		case "dead":
			return errBoom
		}
		return nil
	}}
	enqueue(t, db, ob, msg("orders", "k1", "ok"), msg("orders", "k2", "retry"), msg("payments", "k3", "dead"))
	r, err := sqloutbox.NewRelay(ob, pub, fastRelay(sqloutbox.RelayOptions{MaxAttempts: 3, CleanupInterval: -1,
		Telemetry: consumer.Telemetry{MeterProvider: mp, TracerProvider: spans.TracerProvider}}))
	if err != nil {
		t.Fatal(err)
	}
	rr := start(t, r)
	defer rr.stop(t)

	table := telemetry.AttrTable.String("events_out")
	orders, payments := telemetry.AttrDestination.String("orders"), telemetry.AttrDestination.String("payments")
	testenv.Eventually(t, 30*time.Second, "two published, one dead", func() bool {
		return mp.Sum(telemetry.MetricOutboxPublished, table) == 2 && mp.Sum(telemetry.MetricOutboxDead, table) == 1
	})
	rr.stop(t)
	for _, c := range []struct {
		name  string
		attrs []attribute.KeyValue
		want  float64
	}{
		{telemetry.MetricOutboxPublished, nil, 2},
		{telemetry.MetricOutboxPublished, []attribute.KeyValue{orders}, 2},
		{telemetry.MetricOutboxRetried, []attribute.KeyValue{orders}, 2},   // "retry" at attempts 1 and 2
		{telemetry.MetricOutboxRetried, []attribute.KeyValue{payments}, 2}, // "dead" at attempts 1 and 2
		{telemetry.MetricOutboxDead, []attribute.KeyValue{payments}, 1},
	} {
		if got := mp.Sum(c.name, append([]attribute.KeyValue{table}, c.attrs...)...); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.attrs, got, c.want)
		}
	}
	if mp.Sum(telemetry.MetricOutboxPublishDuration, table, telemetry.AttrResult.String("error")) < 2 {
		t.Errorf("%s: want the batches with failed messages recorded as errors", telemetry.MetricOutboxPublishDuration)
	}
	n := 0
	for _, sp := range spans.Ended() {
		if strings.HasPrefix(sp.Name(), "publish") {
			n++
		}
	}
	if n < 3 {
		t.Errorf("%d producer spans ended, want one per batch (at least 3: each attempt of the failing messages)", n)
	}
}

// NewRelay refuses an OnOutcome: a relay has no consumer.Report to give.
func TestNewRelayRefusesOnOutcome(t *testing.T) {
	db := sqliteDB(t)
	ob := newOutbox(t, db, sqloutbox.SQLite, sqloutbox.Options{})
	_, err := sqloutbox.NewRelay(ob, &memPublisher{}, sqloutbox.RelayOptions{
		Telemetry: consumer.Telemetry{OnOutcome: func(_ context.Context, _ consumer.Report) {}}})
	if err == nil || !strings.Contains(err.Error(), "sqloutbox: RelayOptions.OnOutcome is set") {
		t.Fatalf("NewRelay with OnOutcome = %v, want the OnOutcome error", err)
	}
}
