package walrelay_test

import (
	"context"
	"fmt"
	"net/url"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	kafkago "github.com/segmentio/kafka-go"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/kafkatest"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

var benchPayload = fmt.Appendf(nil, "%0256d", 0)

const (
	benchKeys  = 10000
	benchRound = 20000
)

func benchKey(i int) []byte { return fmt.Appendf(nil, "key-%05d", i%benchKeys) }

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// nopPublisher confirms every message at once.
type nopPublisher struct{}

func (nopPublisher) Publish(context.Context, []*outbox.Message) error { return nil }

// benchPool is a pool on the logical cluster with synchronous commit on
// (the tests' sessions turn it off).
func benchPool(b *testing.B) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(logicalURL(b))
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = 8
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "on"
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	return pool
}

// benchOutbox returns a fresh outbox holding benchRound committed messages
// to topic, in transactions of 1,000.
func benchOutbox(b *testing.B, pool *pgxpool.Pool, src walrelay.Source, topic string) *walrelay.Outbox {
	ctx := context.Background()
	ob := newWAL(b, pool, walrelay.Options{Source: src, Schema: testenv.Schema(b, pool)})
	for i := 0; i < benchRound; i += 1000 {
		var msgs []outbox.Message
		for j := i; j < min(i+1000, benchRound); j++ {
			msgs = append(msgs, outbox.Message{Topic: topic, Key: benchKey(j), Payload: benchPayload})
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { _, err := ob.Enqueue(ctx, tx, msgs...); return err }); err != nil {
			b.Fatal(err)
		}
	}
	return ob
}

// measureRelay runs a relay of ob through pub until it published
// benchRound messages, and returns its rate from Run, and from the start of
// streaming (without the relay's connection set-up, tens of milliseconds on
// a loaded machine, a large part of a round).
func measureRelay(b *testing.B, ob *walrelay.Outbox, pub outbox.Publisher, batch int) (float64, float64) {
	mp, all := telemetrytest.Reach(telemetry.MetricOutboxPublished, benchRound)
	r, err := walrelay.NewRelay(ob, pub, walrelay.RelayOptions{BatchSize: batch, Telemetry: consumer.Telemetry{MeterProvider: mp, Logger: quiet()}, MetricsInterval: time.Hour, CleanupInterval: -1})
	if err != nil {
		b.Fatal(err)
	}
	streaming := make(chan time.Time, 1)
	walrelay.SetOnStreaming(r, func() { streaming <- time.Now() })
	runtime.GC()
	start := time.Now()
	rctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	streamed := <-streaming
	select {
	case <-all:
	case err := <-done:
		b.Fatalf("relay stopped before publishing everything: %v", err)
	}
	end := time.Now()
	stop()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	return benchRound / end.Sub(start).Seconds(), benchRound / end.Sub(streamed).Seconds()
}

// BenchmarkRelayToKafka compares, in one run, the WAL relay publishing
// committed outbox messages to Kafka (kfake in process, or
// IDEM_TEST_KAFKA_BROKERS) through adapters/kafka's Publisher with the bare
// kafka-go Writer publishing the same messages the same way (synchronous
// WriteMessages of 500, RequireAll, the outbox id header, a 4-partition
// topic, BatchTimeout 1ms). Each round publishes benchRound messages on
// benchKeys keys bare, then through the relay reading the table, then the
// logical messages, then both again to a no-op publisher (the relay's own
// ceiling); the medians of the rounds are reported with the relay/bare
// ratios. The relay's time runs from Run to the last message confirmed
// (the "-streaming/bare" ratios: from the start of streaming); the
// messages are committed before it starts and not timed.
//
//	go test -run '^$' -bench RelayToKafka -benchtime 1x ./outbox/walrelay/
func BenchmarkRelayToKafka(b *testing.B) {
	const (
		batch      = 500
		rounds     = 3
		partitions = 4
	)
	k := kafkatest.New(b)
	pool := benchPool(b)
	ctx := context.Background()
	writer := func() *kafkago.Writer {
		return &kafkago.Writer{Addr: kafkago.TCP(k.Brokers...), Balancer: &kafkago.Hash{}, RequiredAcks: kafkago.RequireAll,
			BatchSize: batch, BatchTimeout: time.Millisecond, Transport: k.Transport}
	}
	bare := func() float64 {
		topic := k.Topic(b, "idembench", partitions)
		w := writer()
		defer func() { _ = w.Close() }()
		runtime.GC()
		start := time.Now()
		recs := make([]kafkago.Message, 0, batch)
		for i := 0; i < benchRound; i += batch {
			recs = recs[:0]
			for j := i; j < min(i+batch, benchRound); j++ {
				recs = append(recs, kafkago.Message{Topic: topic, Key: benchKey(j), Value: benchPayload,
					Headers: []kafkago.Header{{Key: outbox.HeaderMessageID, Value: fmt.Appendf(nil, "00000000-0000-7000-8000-%012d", j)}}})
			}
			if err := w.WriteMessages(ctx, recs...); err != nil {
				b.Fatal(err)
			}
		}
		return benchRound / time.Since(start).Seconds()
	}
	relay := func(src walrelay.Source, noBroker bool) (float64, float64) {
		topic := k.Topic(b, "idembench", partitions)
		ob := benchOutbox(b, pool, src, topic)
		w := writer()
		defer func() { _ = w.Close() }()
		var pub outbox.Publisher = nopPublisher{}
		if !noBroker {
			p, err := idemkafka.NewPublisher(w, idemkafka.PublisherOptions{})
			if err != nil {
				b.Fatal(err)
			}
			pub = p
		}
		return measureRelay(b, ob, pub, batch)
	}
	variants := []struct {
		name     string
		src      walrelay.Source
		noBroker bool
	}{
		{"table", walrelay.SourceTable, false},
		{"messages", walrelay.SourceMessages, false},
		{"nobroker-table", walrelay.SourceTable, true},
		{"nobroker-messages", walrelay.SourceMessages, true},
	}
	var bareR []float64
	rates := make([][]float64, len(variants))
	ratios := make([][]float64, len(variants))
	steady := make([][]float64, len(variants))
	for b.Loop() {
		for range rounds {
			x := bare()
			bareR = append(bareR, x)
			for i, v := range variants {
				y, z := relay(v.src, v.noBroker)
				rates[i] = append(rates[i], y)
				ratios[i] = append(ratios[i], y/x)
				steady[i] = append(steady[i], z/x)
			}
		}
	}
	b.ReportMetric(median(bareR), "bare-msgs/s")
	for i, v := range variants {
		b.ReportMetric(median(rates[i]), v.name+"-msgs/s")
		b.ReportMetric(median(ratios[i]), v.name+"/bare")
		b.ReportMetric(median(steady[i]), v.name+"-streaming/bare")
	}
	b.ReportMetric(0, "ns/op")
}

// BenchmarkEnqueue measures the business transaction that enqueues one
// message (an INSERT into a business table, the Enqueue, COMMIT with
// synchronous commit on) with the table source, with the logical messages
// (Enqueue, and QueueEnqueue in the business statement's round trip), and
// the same transaction without any outbox write. The machine is shared
// and a commit waits for fsync, so the three are measured in alternation:
// each round runs benchTx transactions of each, and the medians of the
// rounds' rates and ratios to "none" are reported.
//
//	go test -run '^$' -bench Enqueue -benchtime 1x ./outbox/walrelay/
func BenchmarkEnqueue(b *testing.B) {
	const (
		rounds  = 7
		benchTx = 300
	)
	pool := benchPool(b)
	ctx := context.Background()
	variants := []struct {
		name    string
		src     walrelay.Source
		batched bool
	}{{"none", 0, false}, {"table", walrelay.SourceTable, false}, {"messages", walrelay.SourceMessages, false}, {"messages-batched", walrelay.SourceMessages, true}}
	obs := make([]*walrelay.Outbox, len(variants))
	tables := make([]string, len(variants))
	for i, v := range variants {
		schema := testenv.Schema(b, pool)
		if v.src != 0 {
			obs[i] = newWAL(b, pool, walrelay.Options{Source: v.src, Schema: schema})
		}
		tables[i] = pgx.Identifier{schema, "orders"}.Sanitize()
		if _, err := pool.Exec(ctx, "CREATE TABLE "+tables[i]+" (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, total int NOT NULL)"); err != nil {
			b.Fatal(err)
		}
	}
	run := func(v int) float64 {
		ob, orders := obs[v], tables[v]
		start := time.Now()
		for i := range benchTx {
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if variants[v].batched {
					// The business statement and the outbox write in one
					// round trip (QueueEnqueue).
					batch := &pgx.Batch{}
					batch.Queue("INSERT INTO "+orders+" (total) VALUES ($1)", i)
					if _, err := ob.QueueEnqueue(ctx, batch, outbox.Message{Topic: "orders", Key: benchKey(i), Payload: benchPayload}); err != nil {
						return err
					}
					return tx.SendBatch(ctx, batch).Close()
				}
				if _, err := tx.Exec(ctx, "INSERT INTO "+orders+" (total) VALUES ($1)", i); err != nil {
					return err
				}
				if ob == nil {
					return nil
				}
				_, err := ob.Enqueue(ctx, tx, outbox.Message{Topic: "orders", Key: benchKey(i), Payload: benchPayload})
				return err
			})
			if err != nil {
				b.Fatal(err)
			}
		}
		return benchTx / time.Since(start).Seconds()
	}
	rates := make([][]float64, len(variants))
	ratios := make([][]float64, len(variants))
	for b.Loop() {
		for range rounds {
			var base float64
			for i := range variants {
				r := run(i)
				if i == 0 {
					base = r
				}
				rates[i] = append(rates[i], r)
				ratios[i] = append(ratios[i], r/base)
			}
		}
	}
	for i, v := range variants {
		b.ReportMetric(median(rates[i]), v.name+"-tx/s")
		if i > 0 {
			b.ReportMetric(median(ratios[i]), v.name+"/none")
		}
	}
	b.ReportMetric(0, "ns/op")
}

// latencyPublisher records when each message was confirmed.
type latencyPublisher struct {
	mu sync.Mutex
	at map[string]time.Time
}

func (p *latencyPublisher) Publish(_ context.Context, msgs []*outbox.Message) error {
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		if _, ok := p.at[m.ID]; !ok {
			p.at[m.ID] = now
		}
	}
	return nil
}

// BenchmarkCommitToPublish measures, at benchRate transactions of one
// message per second for a few seconds, the time from Commit returning to
// the relay's Publish call confirming the message (a publisher that
// confirms at once, so the relay's own latency shows), per source. It
// reports the median and the 99th percentile.
//
//	go test -run '^$' -bench CommitToPublish -benchtime 1x ./outbox/walrelay/
func BenchmarkCommitToPublish(b *testing.B) {
	const (
		benchRate = 1000
		total     = 3 * benchRate
	)
	pool := benchPool(b)
	ctx := context.Background()
	for _, src := range []walrelay.Source{walrelay.SourceMessages, walrelay.SourceTable} {
		b.Run(src.String(), func(b *testing.B) {
			var lat []float64
			for b.Loop() {
				ob := newWAL(b, pool, walrelay.Options{Source: src, Schema: testenv.Schema(b, pool)})
				pub := &latencyPublisher{at: map[string]time.Time{}}
				r, err := walrelay.NewRelay(ob, pub, walrelay.RelayOptions{CleanupInterval: -1, Telemetry: consumer.Telemetry{Logger: quiet()}})
				if err != nil {
					b.Fatal(err)
				}
				streaming := make(chan struct{}, 1)
				walrelay.SetOnStreaming(r, func() { streaming <- struct{}{} })
				rctx, stop := context.WithCancel(ctx)
				done := make(chan error, 1)
				go func() { done <- r.Run(rctx) }()
				<-streaming
				committed := map[string]time.Time{}
				tick := time.NewTicker(time.Second / benchRate)
				for i := range total {
					<-tick.C
					var ids []string
					err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
						var err error
						ids, err = ob.Enqueue(ctx, tx, outbox.Message{Topic: "t", Key: benchKey(i), Payload: benchPayload})
						return err
					})
					if err != nil {
						b.Fatal(err)
					}
					committed[ids[0]] = time.Now()
				}
				tick.Stop()
				testenv.Eventually(b, 10*time.Minute, "every message published", func() bool {
					pub.mu.Lock()
					defer pub.mu.Unlock()
					return len(pub.at) >= total
				})
				stop()
				if err := <-done; err != nil {
					b.Fatal(err)
				}
				for id, c := range committed {
					lat = append(lat, pub.at[id].Sub(c).Seconds()*1000)
				}
			}
			slices.Sort(lat)
			b.ReportMetric(lat[len(lat)/2], "p50-ms")
			b.ReportMetric(lat[len(lat)*99/100], "p99-ms")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// BenchmarkRelayToRabbitMQ compares, in one run, the WAL relay publishing
// committed outbox messages to RabbitMQ through adapters/amqp's Publisher
// (persistent, mandatory, publisher confirms, to a durable queue) with the
// bare amqp091-go client publishing the same messages the same way in
// windows of 500. Each round publishes benchRound messages bare, then
// through the relay reading the logical messages, then the table; the
// medians of the rounds are reported with the relay/bare ratios (from Run,
// and from the start of streaming).
//
//	go test -run '^$' -bench RelayToRabbitMQ -benchtime 1x ./outbox/walrelay/
func BenchmarkRelayToRabbitMQ(b *testing.B) {
	const (
		batch  = 500
		rounds = 3
	)
	u, err := url.Parse(testenv.AMQPURL())
	if err != nil {
		b.Fatal(err)
	}
	testenv.RequireTCP(b, "RabbitMQ", u.Host)
	conn, err := amqp091.Dial(testenv.AMQPURL())
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		b.Fatal(err)
	}
	exchange, queue := testenv.Name("idembench_x"), testenv.Name("idembench_q")
	if err := ch.ExchangeDeclare(exchange, amqp091.ExchangeTopic, true, false, false, false, nil); err != nil {
		b.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		b.Fatal(err)
	}
	if err := ch.QueueBind(queue, "#", exchange, false, nil); err != nil {
		b.Fatal(err)
	}
	defer func() {
		_, _ = ch.QueueDelete(queue, false, false, false)
		_ = ch.ExchangeDelete(exchange, false, false)
	}()
	if err := ch.Confirm(false); err != nil {
		b.Fatal(err)
	}
	purge := func() {
		if _, err := ch.QueuePurge(queue, false); err != nil {
			b.Fatal(err)
		}
	}
	pool := benchPool(b)
	bare := func() float64 {
		created := time.Now()
		start := time.Now()
		dcs := make([]*amqp091.DeferredConfirmation, 0, batch)
		for i := 0; i < benchRound; i += batch {
			dcs = dcs[:0]
			for j := i; j < min(i+batch, benchRound); j++ {
				dc, err := ch.PublishWithDeferredConfirm(exchange, string(benchKey(j)), true, false, amqp091.Publishing{
					DeliveryMode: amqp091.Persistent, MessageId: fmt.Sprintf("00000000-0000-7000-8000-%012d", j), Timestamp: created, Body: benchPayload,
				})
				if err != nil {
					b.Fatal(err)
				}
				dcs = append(dcs, dc)
			}
			for _, dc := range dcs {
				if !dc.Wait() {
					b.Fatal("nacked")
				}
			}
		}
		rate := benchRound / time.Since(start).Seconds()
		purge()
		return rate
	}
	relay := func(src walrelay.Source) (float64, float64) {
		ob := benchOutbox(b, pool, src, exchange)
		pub, err := idemamqp.NewPublisher(testenv.AMQPURL(), idemamqp.PublisherOptions{Logger: quiet()})
		if err != nil {
			b.Fatal(err)
		}
		defer pub.Close()
		defer purge()
		return measureRelay(b, ob, pub, batch)
	}
	srcs := []walrelay.Source{walrelay.SourceMessages, walrelay.SourceTable}
	var bareR []float64
	rates := make([][]float64, len(srcs))
	ratios := make([][]float64, len(srcs))
	steady := make([][]float64, len(srcs))
	for b.Loop() {
		for range rounds {
			x := bare()
			bareR = append(bareR, x)
			for i, src := range srcs {
				y, z := relay(src)
				rates[i] = append(rates[i], y)
				ratios[i] = append(ratios[i], y/x)
				steady[i] = append(steady[i], z/x)
			}
		}
	}
	b.ReportMetric(median(bareR), "bare-msgs/s")
	for i, src := range srcs {
		b.ReportMetric(median(rates[i]), src.String()+"-msgs/s")
		b.ReportMetric(median(ratios[i]), src.String()+"/bare")
		b.ReportMetric(median(steady[i]), src.String()+"-streaming/bare")
	}
	b.ReportMetric(0, "ns/op")
}
