package pgoutbox_test

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// kafkaBenchVariant is one relay configuration BenchmarkRelayToKafka
// measures.
type kafkaBenchVariant struct {
	name string
	opts pgoutbox.RelayOptions
	// noBroker publishes to a no-op Publisher instead of Kafka: the relay's
	// own ceiling on this machine (claim and mark in PostgreSQL).
	noBroker bool
}

// nopPublisher confirms every message at once.
type nopPublisher struct{}

func (nopPublisher) Publish(context.Context, []*outbox.Message) error { return nil }

// BenchmarkRelayToKafka compares, in one run, the relay publishing committed
// outbox rows to Kafka (kfake in process, or IDEM_TEST_KAFKA_BROKERS) through
// adapters/kafka's Publisher with the bare kafka-go Writer publishing the same
// messages the same way: synchronous WriteMessages, RequiredAcks RequireAll,
// the outbox id header, a 4-partition topic, in windows of the relay's batch
// size (500). Both use a fresh topic and a fresh Writer per measurement
// (BatchSize 500, BatchTimeout 1ms). The machine is shared, so the two are
// measured in alternation: each round publishes benchRound messages bare, then
// through each relay variant (sessions, batch size, DeletePublished), and the
// medians of the rounds are reported, with the relay/bare ratios. The relay's
// time runs from Run to the last row marked; filling the outbox is not timed.
//
//	go test -run '^$' -bench RelayToKafka -benchtime 1x ./outbox/pgoutbox/
func BenchmarkRelayToKafka(b *testing.B) {
	const (
		batch      = 500
		rounds     = 5
		partitions = 4
	)
	batchTimeout := time.Millisecond
	if s := os.Getenv("IDEM_BENCH_KAFKA_BATCH_TIMEOUT"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			b.Fatal(err)
		}
		batchTimeout = d
	}
	variants := []kafkaBenchVariant{
		{"relay1", pgoutbox.RelayOptions{BatchSize: batch}, false},
		{"relay2", pgoutbox.RelayOptions{BatchSize: batch, Sessions: 2}, false},
		{"relay2del", pgoutbox.RelayOptions{BatchSize: batch, Sessions: 2, DeletePublished: true}, false},
		{"relay4", pgoutbox.RelayOptions{BatchSize: batch, Sessions: 4}, false},
		{"relay2-1000", pgoutbox.RelayOptions{BatchSize: 1000, Sessions: 2}, false},
		{"relay4del", pgoutbox.RelayOptions{BatchSize: batch, Sessions: 4, DeletePublished: true}, false},
		{"nobroker2", pgoutbox.RelayOptions{BatchSize: batch, Sessions: 2}, true},
		{"nobroker2del", pgoutbox.RelayOptions{BatchSize: batch, Sessions: 2, DeletePublished: true}, true},
	}
	k := newKafkaEnv(b)
	pool := testenv.Pool(b, 8)
	ctx := context.Background()

	bare := func() float64 {
		topic := k.createTopic(b, "idembench", partitions)
		defer k.deleteTopic(b, topic)
		w := k.writer(batch, batchTimeout)
		defer func() { _ = w.Close() }()
		runtime.GC()
		start := time.Now()
		recs := make([]kafkago.Message, 0, batch)
		for i := 0; i < benchRound; i += batch {
			recs = recs[:0]
			for j := i; j < min(i+batch, benchRound); j++ {
				recs = append(recs, kafkago.Message{
					Topic: topic, Key: benchKey(j), Value: benchPayload,
					Headers: []kafkago.Header{{Key: outbox.HeaderMessageID, Value: fmt.Appendf(nil, "00000000-0000-7000-8000-%012d", j)}},
				})
			}
			if err := w.WriteMessages(ctx, recs...); err != nil {
				b.Fatal(err)
			}
		}
		return benchRound / time.Since(start).Seconds()
	}
	relay := func(v kafkaBenchVariant) float64 {
		topic := k.createTopic(b, "idembench", partitions)
		defer k.deleteTopic(b, topic)
		ob := newOutbox(b, pool, pgoutbox.Options{})
		for i := 0; i < benchRound; i += 1000 {
			var msgs []outbox.Message
			for j := i; j < min(i+1000, benchRound); j++ {
				msgs = append(msgs, outbox.Message{Topic: topic, Key: benchKey(j), Payload: benchPayload})
			}
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { _, err := ob.Enqueue(ctx, tx, msgs...); return err }); err != nil {
				b.Fatal(err)
			}
		}
		if _, err := pool.Exec(ctx, "VACUUM ANALYZE "+ob.Table()); err != nil {
			b.Fatal(err)
		}
		w := k.writer(batch, batchTimeout)
		defer func() { _ = w.Close() }()
		mp, all := telemetrytest.Reach(telemetry.MetricOutboxPublished, benchRound)
		opts := v.opts
		opts.MeterProvider, opts.MetricsInterval, opts.CleanupInterval, opts.Logger = mp, time.Hour, -1, quiet()
		var pub outbox.Publisher = kafkaPublisher(b, w)
		if v.noBroker {
			pub = nopPublisher{}
		}
		r, err := pgoutbox.NewRelay(ob, pub, opts)
		if err != nil {
			b.Fatal(err)
		}
		runtime.GC()
		start := time.Now()
		rctx, stop := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- r.Run(rctx) }()
		select {
		case <-all:
		case err := <-done:
			b.Fatalf("relay stopped before publishing everything: %v", err)
		}
		rate := benchRound / time.Since(start).Seconds()
		stop()
		if err := <-done; err != nil {
			b.Fatal(err)
		}
		return rate
	}

	var bareR []float64
	rates := make([][]float64, len(variants))
	ratios := make([][]float64, len(variants))
	for b.Loop() {
		for range rounds {
			x := bare()
			bareR = append(bareR, x)
			for i, v := range variants {
				y := relay(v)
				rates[i] = append(rates[i], y)
				ratios[i] = append(ratios[i], y/x)
			}
		}
	}
	b.ReportMetric(median(bareR), "bare-msgs/s")
	for i, v := range variants {
		b.ReportMetric(median(rates[i]), v.name+"-msgs/s")
		b.ReportMetric(median(ratios[i]), v.name+"/bare")
	}
	b.ReportMetric(0, "ns/op")
}
