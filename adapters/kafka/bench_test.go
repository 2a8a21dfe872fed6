package idemkafka_test

import (
	"context"
	"log/slog"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/adapters/kafka/kafkapg"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// The consume benchmarks read b.N records (produced before the timer starts)
// from a 4-partition topic on kfake (or IDEM_TEST_KAFKA_BROKERS) and report
// msgs/s, from the start to the last record handled; the group join is
// included, the shutdown is not. Run them with a fixed count, side by side:
//
//	go test -run '^$' -bench BenchmarkConsume -benchtime 20000x ./adapters/kafka/
//
// bare is the kafka-go Reader loop with a GroupID: FetchMessage, and a
// synchronous CommitMessages every 100 records. idem-nodedup is the Consumer
// with a no-op handler (the adapter's own cost), idem-memstore the same
// behind consumer.Dedup on memstore; both commit every 25 records per
// partition (every 100 across the 4 partitions) and not on a timer. The
// pgtable variants insert one row per record in the transaction of the claim:
// consumer.Transactional per record, kafkapg.Transactional (plus the position
// in the same transaction), kafkapg.Batch without and with the position.

const benchPartitions = 4

// benchTopic makes a topic with b.N records. The topic is deleted when the
// round ends, so that the cluster's memory (kfake keeps records in the test
// process) does not grow from one round or variant to the next and slow the
// later ones down with garbage collection.
func benchTopic(b *testing.B, k *kenv) string {
	b.Helper()
	topic := k.topic(b, "bench", benchPartitions)
	k.dlq(b, topic)
	recs := make([]kafkago.Message, b.N)
	for i := range recs {
		id := "b-" + strconv.Itoa(i)
		recs[i] = rec(i%benchPartitions, id, id, "payload-"+id)
	}
	k.produce(b, topic, recs...)
	runtime.GC()
	return topic
}

func deleteTopic(b *testing.B, k *kenv, topic string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := k.client.DeleteTopics(ctx, &kafkago.DeleteTopicsRequest{Topics: []string{topic, topic + "_dlq"}}); err != nil {
		b.Logf("delete topic %s: %v", topic, err)
	}
}

func reportRate(b *testing.B, n int, d time.Duration) {
	b.ReportMetric(float64(n)/d.Seconds(), "msgs/s")
}

// benchConsumer runs c until n records are done and reports the rate.
func benchConsumer(b *testing.B, n int, done *atomic.Int64, finished chan struct{}, c *idemkafka.Consumer) {
	b.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	start := time.Now()
	errc := make(chan error, 1)
	go func() { errc <- c.Run(ctx) }()
	select {
	case <-finished:
	case <-time.After(10 * time.Minute):
		b.Errorf("only %d of %d records handled", done.Load(), n)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	cancel()
	if err := <-errc; err != nil {
		b.Error(err)
	}
	reportRate(b, n, elapsed)
}

// counting returns an OnOutcome that counts acknowledged records and closes
// finished at n.
func counting(n int) (*atomic.Int64, chan struct{}, func(context.Context, consumer.Report)) {
	var done atomic.Int64
	finished := make(chan struct{})
	return &done, finished, func(_ context.Context, r consumer.Report) {
		if r.Result.Action == consumer.ActionAck && done.Add(1) == int64(n) {
			close(finished)
		}
	}
}

func benchOptions(b *testing.B, topic string, onOutcome func(context.Context, consumer.Report)) idemkafka.ConsumerOptions {
	return idemkafka.ConsumerOptions{
		CommitEvery:     100 / benchPartitions,
		CommitInterval:  time.Hour,
		DeadLetterTopic: topic + "_dlq",
		Telemetry: consumer.Telemetry{
			OnOutcome: onOutcome,
			Logger:    slog.New(slog.NewTextHandler(tWriter{b}, &slog.HandlerOptions{Level: slog.LevelWarn})),
		},
	}
}

func BenchmarkConsume(b *testing.B) {
	k := newKafka(b)

	b.Run("bare", func(b *testing.B) {
		topic := benchTopic(b, k)
		defer deleteTopic(b, k, topic)
		cfg := k.readerConfig(testenv.Name("g"), topic)
		r := kafkago.NewReader(cfg)
		ctx := context.Background()
		batch := make([]kafkago.Message, 0, 100)
		b.ResetTimer()
		start := time.Now()
		for i := 0; i < b.N; i++ {
			m, err := r.FetchMessage(ctx)
			if err != nil {
				b.Fatal(err)
			}
			batch = append(batch, m)
			if len(batch) == 100 || i == b.N-1 {
				if err := r.CommitMessages(ctx, batch...); err != nil {
					b.Fatal(err)
				}
				batch = batch[:0]
			}
		}
		elapsed := time.Since(start)
		b.StopTimer()
		_ = r.Close()
		reportRate(b, b.N, elapsed)
	})

	b.Run("idem-nodedup", func(b *testing.B) {
		topic := benchTopic(b, k)
		defer deleteTopic(b, k, topic)
		h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
		done, finished, onResult := counting(b.N)
		c, err := idemkafka.NewConsumer(k.readerConfig(testenv.Name("g"), topic), h, benchOptions(b, topic, onResult))
		if err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		benchConsumer(b, b.N, done, finished, c)
	})

	// idem-nodedup-otel is idem-nodedup with OpenTelemetry SDK providers
	// installed: every record's span sampled and recorded (then dropped:
	// no exporter), its verdict counted by a metric reader.
	b.Run("idem-nodedup-otel", func(b *testing.B) {
		topic := benchTopic(b, k)
		defer deleteTopic(b, k, topic)
		h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
		done, finished, onResult := counting(b.N)
		opts := benchOptions(b, topic, onResult)
		opts.MeterProvider, opts.TracerProvider = benchSDK(b)
		c, err := idemkafka.NewConsumer(k.readerConfig(testenv.Name("g"), topic), h, opts)
		if err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		benchConsumer(b, b.N, done, finished, c)
	})

	b.Run("idem-memstore", func(b *testing.B) {
		topic := benchTopic(b, k)
		defer deleteTopic(b, k, topic)
		store, err := memstore.New(memstore.Options{})
		if err != nil {
			b.Fatal(err)
		}
		defer store.Close()
		dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "bench/noop"})
		if err != nil {
			b.Fatal(err)
		}
		h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }), dd)
		done, finished, onResult := counting(b.N)
		c, err := idemkafka.NewConsumer(k.readerConfig(testenv.Name("g"), topic), h, benchOptions(b, topic, onResult))
		if err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		benchConsumer(b, b.N, done, finished, c)
	})

	pgSetup := func(b *testing.B) (*pgxpool.Pool, *pgtable.Store, *kafkapg.Offsets, consumer.TxHandler[pgx.Tx]) {
		pool := testenv.Pool(b, 8)
		schema := testenv.Schema(b, pool)
		ctx := context.Background()
		claims, err := pgtable.New(pool, pgtable.Options{Schema: schema})
		if err != nil {
			b.Fatal(err)
		}
		offsets, err := kafkapg.NewOffsets(pool, kafkapg.OffsetsOptions{Schema: schema})
		if err != nil {
			b.Fatal(err)
		}
		if err := claims.Migrate(ctx); err != nil {
			b.Fatal(err)
		}
		if err := offsets.Migrate(ctx); err != nil {
			b.Fatal(err)
		}
		effects := pgx.Identifier{schema, "effects"}.Sanitize()
		if _, err := pool.Exec(ctx, "CREATE TABLE "+effects+" (id text NOT NULL, payload bytea)"); err != nil {
			b.Fatal(err)
		}
		insert := "INSERT INTO " + effects + " (id, payload) VALUES ($1, $2)"
		return pool, claims, offsets, func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			_, err := tx.Exec(ctx, insert, msg.ID, msg.Payload)
			return err
		}
	}

	b.Run("pgtable-claim", func(b *testing.B) {
		_, claims, _, effect := pgSetup(b)
		topic := benchTopic(b, k)
		defer deleteTopic(b, k, topic)
		h, err := consumer.Transactional(claims, consumer.TxOptions{Scope: "bench/pg"}, effect)
		if err != nil {
			b.Fatal(err)
		}
		done, finished, onResult := counting(b.N)
		c, err := idemkafka.NewConsumer(k.readerConfig(testenv.Name("g"), topic), h, benchOptions(b, topic, onResult))
		if err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		benchConsumer(b, b.N, done, finished, c)
	})

	b.Run("pgtable-claim-offsets", func(b *testing.B) {
		_, claims, offsets, effect := pgSetup(b)
		topic := benchTopic(b, k)
		defer deleteTopic(b, k, topic)
		h, err := kafkapg.Transactional(claims, offsets, consumer.TxOptions{Scope: "bench/pg"}, effect)
		if err != nil {
			b.Fatal(err)
		}
		done, finished, onResult := counting(b.N)
		opts := benchOptions(b, topic, onResult)
		opts.Offsets = offsets
		c, err := idemkafka.NewConsumer(k.readerConfig(testenv.Name("g"), topic), h, opts)
		if err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		benchConsumer(b, b.N, done, finished, c)
	})

	for _, withOffsets := range []bool{false, true} {
		name := "pgtable-batch"
		if withOffsets {
			name += "-offsets"
		}
		b.Run(name, func(b *testing.B) {
			pool, claims, offsets, effect := pgSetup(b)
			topic := benchTopic(b, k)
			defer deleteTopic(b, k, topic)
			defer deleteTopic(b, k, topic)
			bo := kafkapg.BatchOptions{Scope: "bench/pg"}
			if withOffsets {
				bo.Offsets = offsets
			}
			bh, err := kafkapg.Batch(pool, claims, bo, effect)
			if err != nil {
				b.Fatal(err)
			}
			done, finished, onResult := counting(b.N)
			opts := benchOptions(b, topic, onResult)
			if withOffsets {
				opts.Offsets = offsets
			}
			c, err := idemkafka.NewBatchConsumer(k.readerConfig(testenv.Name("g"), topic), bh, opts)
			if err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			benchConsumer(b, b.N, done, finished, c)
		})
	}
}

// benchSDK returns OpenTelemetry SDK providers that record everything and
// export nothing, shut down when the benchmark ends.
func benchSDK(b *testing.B) (*sdkmetric.MeterProvider, *sdktrace.TracerProvider) {
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()))
	b.Cleanup(func() {
		_ = mp.Shutdown(context.Background())
		_ = tp.Shutdown(context.Background())
	})
	return mp, tp
}

// BenchmarkDeliveryTelemetry is what the Consumer adds per handler run: the
// consumer span continued from the record's headers, the verdict counted
// and timed. defaults is the OpenTelemetry globals with nothing installed
// (no-ops), sdk the SDK recording everything; traced records carry a
// traceparent, untraced ones none.
//
//	go test -run '^$' -bench BenchmarkDeliveryTelemetry ./adapters/kafka/
func BenchmarkDeliveryTelemetry(b *testing.B) {
	untraced := []kafkago.Header{
		{Key: outbox.HeaderMessageID, Value: []byte("order-1")},
		{Key: "content-type", Value: []byte("application/json")},
	}
	traced := []kafkago.Header{untraced[0], untraced[1], {Key: outbox.HeaderTraceParent, Value: []byte(validTP)}}
	for _, v := range []struct {
		name string
		sdk  bool
		hs   []kafkago.Header
	}{
		{"defaults-untraced", false, untraced}, {"defaults-traced", false, traced},
		{"sdk-untraced", true, untraced}, {"sdk-traced", true, traced},
	} {
		b.Run(v.name, func(b *testing.B) {
			hs := v.hs
			var a *telemetry.Adapter
			if v.sdk {
				mp, tp := benchSDK(b)
				a = telemetry.NewAdapter(mp, tp, "kafka")
			} else {
				a = telemetry.NewAdapter(nil, nil, "kafka")
			}
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				start := time.Now()
				sctx, end := a.StartConsumer(ctx, nil, (*idemkafka.HeaderCarrier)(&hs), "orders")
				a.Result(sctx, "orders", "ack", "", time.Since(start))
				end("ack", nil)
			}
		})
	}
}
