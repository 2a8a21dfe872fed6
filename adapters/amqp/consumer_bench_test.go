package idemamqp

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// consBenchN is the number of persistent messages one variant consumes per
// round.
const consBenchN = 5000

// BenchmarkConsumer compares, side by side in interleaved rounds, a bare
// amqp091-go consumer (one goroutine, manual ACK, prefetch 100) with the
// idem Consumer (prefetch 100, 8 concurrent handlers, Dedup + Recover) on
// memstore and on redisnx (the default InFlight: 64 deliveries in store
// round trips or handlers), on redisnx with 32 handlers, and on redisnx with
// 8 handlers and InFlight 8 (each handler waits for its own store round
// trips, as before InFlight). Each round publishes consBenchN persistent
// messages per variant (untimed), then times each consumer from connecting
// to its last ACK. It reports msgs/s per variant and the ratios to bare.
// The bare loop acknowledges each message on its own, as a hand-written
// worker does; the idem Consumer coalesces its ACKs into multiple acks (see
// Consumer), and its "last ACK" is the OnOutcome of the last delivery,
// called once the ack covering it was written.
//
//	go test -run '^$' -bench BenchmarkConsumer -benchtime 5x ./adapters/amqp/
func BenchmarkConsumer(b *testing.B) {
	url := testenv.AMQPURL()
	rdb := testenv.Redis(b)
	type variant struct {
		name string
		run  func(b *testing.B, queue string) time.Duration
	}
	idem := func(store func(b *testing.B) consumer.Middleware, concurrency, inFlight int) func(b *testing.B, queue string) time.Duration {
		return func(b *testing.B, queue string) time.Duration {
			return consBenchIdem(b, url, queue, store(b), concurrency, inFlight)
		}
	}
	mem := func(b *testing.B) consumer.Middleware { return consMemDedup(b, "bench/mem") }
	rnx := func(b *testing.B) consumer.Middleware {
		store, err := redisnx.New(rdb, redisnx.Options{Prefix: testenv.Name("idembench"), TTL: 5 * time.Minute})
		if err != nil {
			b.Fatal(err)
		}
		mw, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "bench/redis"})
		if err != nil {
			b.Fatal(err)
		}
		return mw
	}
	vs := []variant{
		{"bare", func(b *testing.B, q string) time.Duration { return consBenchBare(b, url, q) }},
		{"memstore", idem(mem, 8, 0)},
		// 8 handlers, and the default InFlight of 64 deliveries in store
		// round trips or handlers.
		{"redisnx", idem(rnx, 8, 0)},
		// A store a round trip away hides its latency behind more
		// handlers; redisnx coalesces their calls into shared pipelines.
		{"redisnx-32", idem(rnx, 32, 0)},
		// 8 handlers that hold their slot through the store's round
		// trips, as before InFlight: what the handler-slot handoff buys.
		{"redisnx-inflight8", idem(rnx, 8, 8)},
	}
	queues := make([]string, len(vs))
	for i := range vs {
		queues[i] = consQueue(b, url, []time.Duration{time.Second})
	}
	total := make([]time.Duration, len(vs))
	b.ResetTimer()
	for round := 0; round < b.N; round++ {
		for k := range vs {
			i := (k + round) % len(vs) // rotate who goes first
			b.StopTimer()
			consPublish(b, url, queues[i], consMsgs(fmt.Sprintf("r%d-%s", round, vs[i].name), consBenchN)...)
			b.StartTimer()
			total[i] += vs[i].run(b, queues[i])
		}
	}
	b.StopTimer()
	rate := make([]float64, len(vs))
	for i, v := range vs {
		rate[i] = float64(consBenchN*b.N) / total[i].Seconds()
		b.ReportMetric(rate[i], v.name+"-msgs/s")
	}
	b.ReportMetric(rate[1]/rate[0], "memstore/bare")
	b.ReportMetric(rate[2]/rate[0], "redisnx/bare")
	b.ReportMetric(rate[3]/rate[0], "redisnx-32/bare")
	b.ReportMetric(rate[4]/rate[0], "redisnx-inflight8/bare")
	b.ReportMetric(0, "ns/op")
}

func consBenchBare(b *testing.B, url, queue string) time.Duration {
	start := time.Now()
	conn, err := amqp091.Dial(url)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		b.Fatal(err)
	}
	if err := ch.Qos(100, 0, false); err != nil {
		b.Fatal(err)
	}
	ds, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		b.Fatal(err)
	}
	for n := 0; n < consBenchN; n++ {
		d, ok := <-ds
		if !ok {
			b.Fatal("deliveries closed")
		}
		if err := d.Ack(false); err != nil {
			b.Fatal(err)
		}
	}
	return time.Since(start)
}

func consBenchIdem(b *testing.B, url, queue string, dedupMW consumer.Middleware, concurrency, inFlight int) time.Duration {
	var acked atomic.Int64
	all := make(chan struct{})
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }), consumer.Recover(), dedupMW)
	c, err := NewConsumer(url, queue, h, ConsumerOptions{
		Prefetch: 100, Concurrency: concurrency, InFlight: inFlight, Backoff: consumer.Backoff{Initial: time.Second, Max: time.Second},
		Telemetry: consumer.Telemetry{
			Logger: consQuiet(),
			OnOutcome: func(_ context.Context, r consumer.Report) {
				if r.Result.Action == consumer.ActionAck && acked.Add(1) == consBenchN {
					close(all)
				}
			},
		},
	})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- c.Run(ctx) }()
	select {
	case <-all:
	case err := <-done:
		cancel()
		b.Fatalf("Run: %v", err)
	case <-time.After(2 * time.Minute):
		b.Fatal("timed out")
	}
	elapsed := time.Since(start)
	cancel()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	return elapsed
}
