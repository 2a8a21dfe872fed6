package main

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// The relay command publishes the outbox's rows to Kafka, stops gracefully
// on cancellation (SIGTERM in main) and, restarted, publishes the rest:
// every row arrives.
func TestRelay(t *testing.T) {
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	pg := []string{"--postgres", testenv.PostgresURL(), "--schema", schema}
	if code, _, errOut := runCmd(ctx, t, append([]string{"migrate", "up"}, pg...)...); code != 0 {
		t.Fatalf("migrate up: %s", errOut)
	}
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(2, "payments", "payments.dlq"))
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	brokers := cluster.ListenAddrs()[0]

	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	enqueue := func(from, to int) {
		t.Helper()
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var msgs []outbox.Message
			for i := from; i < to; i++ {
				msgs = append(msgs, outbox.Message{Topic: "payments", Key: fmt.Appendf(nil, "c%d", i%7), Payload: fmt.Appendf(nil, "%d", i)})
			}
			_, err := ob.Enqueue(ctx, tx, msgs...)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	startRelay := func() (stop func()) {
		rctx, rcancel := context.WithCancel(ctx)
		var (
			wg   sync.WaitGroup
			code int
			out  string
		)
		wg.Go(func() {
			code, _, out = runCmd(rctx, t, append([]string{"relay", "--kafka", brokers, "--poll", "50ms", "--log-level", "warn"}, pg...)...)
		})
		return func() {
			rcancel()
			wg.Wait()
			if code != 0 {
				t.Errorf("relay exit %d: %s", code, out)
			}
		}
	}

	const n = 300
	enqueue(0, n/2)
	stop := startRelay()
	enqueue(n/2, n)
	// Stop it once it has published something: mid-stream, perhaps, but
	// never before it connected (a stop during start-up exits 1).
	testenv.Eventually(t, 30*time.Second, "the relay to publish something", func() bool {
		pending, _, err := ob.Backlog(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return pending < n
	})
	stop()
	stop = startRelay()
	defer stop()

	// Consume until every message arrived.
	var (
		mu   sync.Mutex
		seen = map[string]bool{}
	)
	cctx, ccancel := context.WithCancel(ctx)
	defer ccancel()
	c, err := idemkafka.NewConsumer(kafkago.ReaderConfig{Brokers: []string{brokers}, GroupID: "relay-test", Topic: "payments", MaxWait: 50 * time.Millisecond},
		consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
			mu.Lock()
			defer mu.Unlock()
			seen[string(msg.Payload)] = true
			if len(seen) == n {
				ccancel()
			}
			return nil
		}), idemkafka.ConsumerOptions{DeadLetterTopic: "payments.dlq"})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Run(cctx); err != nil {
		t.Fatal(err)
	}
	if ctx.Err() != nil {
		t.Fatalf("timed out with %d of %d messages delivered", len(seen), n)
	}
	// The relay marks a row once the broker confirmed it, so the last
	// marks may come after the consumer read the messages.
	testenv.Eventually(t, 30*time.Second, "the relay to mark every row published", func() bool {
		pending, _, err := ob.Backlog(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return pending == 0
	})
}
