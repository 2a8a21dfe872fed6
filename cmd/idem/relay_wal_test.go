package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

// relay --source wal streams the outbox from a logical replication slot to
// Kafka: every message committed after the slot was made arrives, and
// "relay slot show" and "relay slot drop" report and drop the slot.
func TestRelayWAL(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	pg, err := fault.StartLogicalPostgres(ctx)
	if err != nil {
		testenv.Unavailable(t, "a throwaway PostgreSQL with wal_level = logical cannot start: "+err.Error())
	}
	t.Cleanup(func() { _ = pg.Close() })
	pool, err := pgxpool.New(ctx, pg.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	pgArgs := []string{"--postgres", pg.URL()}

	// No slot yet: show fails and says so.
	if code, _, errOut := runCmd(ctx, t, append([]string{"relay", "slot", "show"}, pgArgs...)...); code != 1 || !strings.Contains(errOut, "slot does not exist") {
		t.Fatalf("slot show before the relay: exit %d, %q; want 1 and no slot", code, errOut)
	}

	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(2, "payments", "payments.dlq"))
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	brokers := cluster.ListenAddrs()[0]

	// The slot is made before the first message, as the relay's own first
	// start would make it.
	ob, err := walrelay.New(pool, walrelay.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	const n = 200
	for i := range n / 20 {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var msgs []outbox.Message
			for j := range 20 {
				k := i*20 + j
				msgs = append(msgs, outbox.Message{Topic: "payments", Key: fmt.Appendf(nil, "c%d", k%7), Payload: fmt.Appendf(nil, "%d", k)})
			}
			_, err := ob.Enqueue(ctx, tx, msgs...)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}

	rctx, rcancel := context.WithCancel(ctx)
	var (
		wg   sync.WaitGroup
		code int
		out  string
	)
	wg.Go(func() {
		code, _, out = runCmd(rctx, t, append([]string{"relay", "--source", "wal", "--kafka", brokers, "--log-level", "warn"}, pgArgs...)...)
	})

	var (
		mu   sync.Mutex
		seen = map[string]bool{}
	)
	cctx, ccancel := context.WithCancel(ctx)
	defer ccancel()
	c, err := idemkafka.NewConsumer(kafkago.ReaderConfig{Brokers: []string{brokers}, GroupID: "relay-wal-test", Topic: "payments", MaxWait: 50 * time.Millisecond},
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

	// While the relay streams the slot, it cannot be dropped.
	if code, _, errOut := runCmd(ctx, t, append([]string{"relay", "slot", "drop"}, pgArgs...)...); code != 1 || !strings.Contains(errOut, "stop the relay") {
		t.Errorf("slot drop while streamed: exit %d, %q; want 1 and a hint", code, errOut)
	}
	rcancel()
	wg.Wait()
	if code != 0 {
		t.Fatalf("relay exit %d: %s", code, out)
	}

	code, stdout, errOut := runCmd(ctx, t, append([]string{"relay", "slot", "show"}, pgArgs...)...)
	if code != 0 || !strings.Contains(stdout, ob.Options().Slot) || !strings.Contains(stdout, "idle") {
		t.Fatalf("slot show: exit %d, %q, %q; want the idle slot", code, stdout, errOut)
	}
	if code, _, errOut := runCmd(ctx, t, append([]string{"relay", "slot", "drop"}, pgArgs...)...); code != 0 {
		t.Fatalf("slot drop: exit %d, %q", code, errOut)
	}
	if code, _, _ := runCmd(ctx, t, append([]string{"relay", "slot", "show"}, pgArgs...)...); code != 1 {
		t.Fatalf("slot show after the drop: exit %d, want 1", code)
	}
}

// relay --source wal on a server without wal_level = logical fails at once
// and says what to change.
func TestRelayWALNeedsLogical(t *testing.T) {
	testenv.Pool(t, 1) // the shared server, wal_level = replica
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	code, _, errOut := runCmd(ctx, t, "relay", "--source", "wal", "--amqp", testenv.AMQPURL(), "--postgres", testenv.PostgresURL())
	if code == 0 || !strings.Contains(errOut, "wal_level") {
		t.Fatalf("exit %d, %q; want a failure naming wal_level", code, errOut)
	}
}
