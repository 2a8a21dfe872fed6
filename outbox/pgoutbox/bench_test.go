package pgoutbox_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/outboxtest"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// benchPayload is the body of every benchmark message.
var benchPayload = []byte(fmt.Sprintf("%0256d", 0))

const benchKeys = 10000

func benchKey(i int) []byte { return []byte(fmt.Sprintf("key-%05d", i%benchKeys)) }

// BenchmarkRelayToRabbitMQ compares, in one run, the relay publishing
// committed outbox rows to RabbitMQ (persistent messages, publisher
// confirms, mandatory, to a durable queue) with the bare amqp091-go client
// publishing the same messages the same way, in windows of the relay's batch
// size (500). The machine is shared, so the two are measured in alternation:
// each round publishes benchRound messages bare, then through a relay of one
// session, of two sessions (two batches in flight), and of two sessions that
// delete published rows instead of marking them (DeletePublished), and the
// medians of
// the rounds are reported, with the relay/bare ratios. The relay's time runs
// from Run to the last row marked; filling the outbox is not timed.
//
//	go test -run '^$' -bench RelayToRabbitMQ -benchtime 1x ./outbox/pgoutbox/
func BenchmarkRelayToRabbitMQ(b *testing.B) {
	const (
		batch  = 500
		rounds = 5
	)
	rb := outboxtest.NewRabbit(b, "", true)
	pool := testenv.Pool(b, 8)
	purge := func() {
		rb.Admin(func(ch *amqp091.Channel) error { _, err := ch.QueuePurge(rb.Queue, false); return err })
	}
	conn, err := amqp091.Dial(rb.URL)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		b.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		b.Fatal(err)
	}

	bare := func() float64 {
		created := time.Now()
		start := time.Now()
		dcs := make([]*amqp091.DeferredConfirmation, 0, batch)
		for i := 0; i < benchRound; i += batch {
			dcs = dcs[:0]
			for j := i; j < min(i+batch, benchRound); j++ {
				dc, err := ch.PublishWithDeferredConfirm(rb.Exchange, string(benchKey(j)), true, false, amqp091.Publishing{
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
	relay := func(sessions int, del bool) float64 {
		ob := newOutbox(b, pool, pgoutbox.Options{})
		ctx := context.Background()
		for i := 0; i < benchRound; i += 1000 {
			var msgs []outbox.Message
			for j := i; j < min(i+1000, benchRound); j++ {
				msgs = append(msgs, outbox.Message{Topic: rb.Exchange, Key: benchKey(j), Payload: benchPayload})
			}
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { _, err := ob.Enqueue(ctx, tx, msgs...); return err }); err != nil {
				b.Fatal(err)
			}
		}
		if _, err := pool.Exec(ctx, "VACUUM ANALYZE "+ob.Table()); err != nil {
			b.Fatal(err)
		}
		pub := newAMQPPublisher(b, rb.URL)
		mp, all := telemetrytest.Reach(telemetry.MetricOutboxPublished, benchRound)
		r, err := pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{
			BatchSize: batch, Sessions: sessions, DeletePublished: del, Telemetry: consumer.Telemetry{MeterProvider: mp, Logger: quiet()}, MetricsInterval: time.Hour, CleanupInterval: -1,
		})
		if err != nil {
			b.Fatal(err)
		}
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
		_ = pub.Close()
		purge()
		return rate
	}

	var bareR, r1, r2, r2d, q1, q2, q2d []float64
	for b.Loop() {
		for range rounds {
			x, y, z, w := bare(), relay(1, false), relay(2, false), relay(2, true)
			bareR, r1, r2, r2d = append(bareR, x), append(r1, y), append(r2, z), append(r2d, w)
			q1, q2, q2d = append(q1, y/x), append(q2, z/x), append(q2d, w/x)
		}
	}
	b.ReportMetric(median(bareR), "bare-msgs/s")
	b.ReportMetric(median(r1), "relay1-msgs/s")
	b.ReportMetric(median(r2), "relay2-msgs/s")
	b.ReportMetric(median(r2d), "relay2del-msgs/s")
	b.ReportMetric(median(q1), "relay1/bare")
	b.ReportMetric(median(q2), "relay2/bare")
	b.ReportMetric(median(q2d), "relay2del/bare")
	b.ReportMetric(0, "ns/op")
}

// benchRound is the number of messages of one throughput measurement.
const benchRound = 10000

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// latencyPublisher records when each message was confirmed.
type latencyPublisher struct {
	outbox.Publisher
	mu        sync.Mutex
	confirmed map[string]time.Time
}

func (p *latencyPublisher) Publish(ctx context.Context, msgs []*outbox.Message) error {
	err := p.Publisher.Publish(ctx, msgs)
	now := time.Now()
	if err == nil {
		p.mu.Lock()
		for _, m := range msgs {
			if _, ok := p.confirmed[m.ID]; !ok {
				p.confirmed[m.ID] = now
			}
		}
		p.mu.Unlock()
	}
	return err
}

// BenchmarkCommitToPublishLatency measures, with LISTEN/NOTIFY, the time
// from a business transaction's commit (Commit returned) to the broker's
// confirm of its message, over 10,000 messages committed one per
// transaction at a steady 1,000 per second (offered-msgs/s is the rate the
// producers reached), with a relay of one and of two sessions. It reports
// p50, p99 and max in milliseconds; one iteration takes about 10 seconds.
//
//	go test -run '^$' -bench CommitToPublishLatency -benchtime 1x ./outbox/pgoutbox/
func BenchmarkCommitToPublishLatency(b *testing.B) {
	for _, sessions := range []int{1, 2} {
		b.Run(fmt.Sprintf("sessions-%d", sessions), func(b *testing.B) { benchLatency(b, sessions) })
	}
}

func benchLatency(b *testing.B, sessions int) {
	const (
		total = 10000
		rate  = 1000 // per second
	)
	rb := outboxtest.NewRabbit(b, "", true)
	pool := testenv.Pool(b, 12)
	ob := newOutbox(b, pool, pgoutbox.Options{})
	pub := &latencyPublisher{Publisher: newAMQPPublisher(b, rb.URL), confirmed: map[string]time.Time{}}
	r, err := pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{CleanupInterval: -1, Telemetry: consumer.Telemetry{Logger: quiet()}, Sessions: sessions})
	if err != nil {
		b.Fatal(err)
	}
	rr := start(b, r)
	defer rr.stop(b)
	ctx := context.Background()

	var lat []time.Duration
	for b.Loop() {
		committed := make(map[string]time.Time, total)
		var cmu sync.Mutex
		var wg sync.WaitGroup
		var next atomic.Int64
		begin := time.Now()
		// Ten producers share one schedule: message i commits at begin +
		// i/rate (or as soon as possible when behind).
		for range 10 {
			wg.Go(func() {
				for {
					i := next.Add(1) - 1
					if i >= total {
						return
					}
					if d := time.Until(begin.Add(time.Duration(i) * time.Second / rate)); d > 0 {
						time.Sleep(d)
					}
					var ids []string
					err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
						var err error
						ids, err = ob.Enqueue(ctx, tx, outbox.Message{Topic: rb.Exchange, Key: benchKey(int(i)), Payload: benchPayload})
						return err
					})
					now := time.Now()
					if err != nil {
						b.Error(err)
						return
					}
					cmu.Lock()
					committed[ids[0]] = now
					cmu.Unlock()
				}
			})
		}
		wg.Wait()
		sent := time.Since(begin)
		testenv.Eventually(b, 10*time.Minute, "every message confirmed", func() bool {
			pub.mu.Lock()
			defer pub.mu.Unlock()
			n := 0
			for id := range committed {
				if _, ok := pub.confirmed[id]; ok {
					n++
				}
			}
			return n == total
		})
		pub.mu.Lock()
		for id, c := range committed {
			lat = append(lat, max(pub.confirmed[id].Sub(c), 0))
		}
		pub.mu.Unlock()
		b.ReportMetric(float64(total)/sent.Seconds(), "offered-msgs/s")
	}
	slices.Sort(lat)
	pct := func(p float64) float64 {
		return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))]) / float64(time.Millisecond)
	}
	b.ReportMetric(pct(0.50), "p50-ms")
	b.ReportMetric(pct(0.99), "p99-ms")
	b.ReportMetric(float64(lat[len(lat)-1])/float64(time.Millisecond), "max-ms")
	b.ReportMetric(0, "ns/op")
}
