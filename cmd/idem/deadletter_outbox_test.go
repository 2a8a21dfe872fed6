package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// TestDeadletterOutbox: "idem relay" publishes an outbox to RabbitMQ; the
// messages whose routing key no queue is bound to come back unroutable
// and are parked dead. "idem deadletter --outbox" lists them, replays
// nothing with --dry-run, discards one, and once the binding exists
// replays the rest in two runs: the relay publishes them again with their
// ids, and the oracle checks that the consumer applied every message but
// the discarded one exactly once.
func TestDeadletterOutbox(t *testing.T) {
	requireRabbitMQ(t)
	url := testenv.AMQPURL()
	pool, schema, pg := migratedSchema(t, 4)
	conn, err := amqp091.DialConfig(url, amqp091.Config{Dial: amqp091.DefaultDial(5 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	admin, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	exchange, queue := testenv.Name("idemdlx"), testenv.Name("idemdlq")
	if err := admin.ExchangeDeclare(exchange, amqp091.ExchangeDirect, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	opts := idemamqp.ConsumerOptions{Bindings: []idemamqp.ConsumerBinding{{Exchange: exchange, Key: "pay"}},
		Telemetry: consumer.Telemetry{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = idemamqp.DeleteTopology(ctx, conn, queue, opts)
		_ = admin.ExchangeDelete(exchange, false, false)
	})

	oracle := newPoisonOracle(t)
	oracle.fixed.Store(true) // the handler is fine: the route is what fails
	c, err := idemamqp.NewConsumer(url, queue, oracle.handler(t, "billing/charge"), opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	relayDone := make(chan int, 1)
	go func() {
		code, _, _ := runCmd(ctx, t, append([]string{"relay", "--amqp", url, "--max-attempts", "2", "--poll", "100ms", "--log-level", "error"}, pg...)...)
		relayDone <- code
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("consumer: %v", err)
		}
		if code := <-relayDone; code != 0 {
			t.Errorf("relay exited %d", code)
		}
	})
	select {
	case <-c.Ready():
	case <-time.After(30 * time.Second):
		t.Fatal("the consumer is not ready")
	}

	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	var ok, late []string
	err = pgx.BeginFunc(testenv.Ctx(t), pool, func(tx pgx.Tx) error {
		var msgs []outbox.Message
		for i := range 4 {
			msgs = append(msgs, outbox.Message{Topic: exchange, Key: []byte("pay"), Payload: []byte("ok-pay")})
			if i < 3 {
				msgs = append(msgs, outbox.Message{Topic: exchange, Key: []byte("later"), Payload: []byte("ok-later")})
			}
		}
		ids, err := ob.Enqueue(testenv.Ctx(t), tx, msgs...)
		for i, id := range ids {
			if string(msgs[i].Key) == "pay" {
				ok = append(ok, id)
			} else {
				late = append(late, id)
			}
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	r := dlqRun{t: t, flags: append([]string{"--outbox"}, pg...)}
	testenv.Eventually(t, 60*time.Second, "3 dead rows and 4 messages applied", func() bool {
		return r.count() == 3 && len(oracle.applied(t)) == 4
	})
	oracle.check(t, ok)

	out := r.run(0, "list")
	if groupCount(t, out, "retries_exhausted", exchange) != 3 || !strings.Contains(out, "unroutable") {
		t.Fatalf("list:\n%s\nwant 3 retries_exhausted letters to %s, unroutable", out, exchange)
	}
	out = r.run(0, "show", late[0])
	for _, want := range []string{"message id   " + late[0], "attempts     2", `key          "later"`, `payload      8 bytes: "ok-later"`} {
		if !strings.Contains(out, want) {
			t.Errorf("show lacks %q:\n%s", want, out)
		}
	}
	out = r.run(0, "replay", "--all", "--dry-run")
	if s := summary(t, out); !strings.Contains(s, "would replay 3") || r.count() != 3 {
		t.Fatalf("dry run: %q", s)
	}
	r.run(0, "discard", "--id", late[2])
	if n := r.count(); n != 2 {
		t.Fatalf("%d dead rows after the discard, want 2", n)
	}

	if err := admin.QueueBind(queue, "later", exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	if replayed, _ := summaryCounts(t, r.run(0, "replay", "--reason", "retries_exhausted", "--limit", "1")); replayed != 1 {
		t.Errorf("replay --limit 1: %d replayed", replayed)
	}
	if replayed, _ := summaryCounts(t, r.run(0, "replay", "--all")); replayed != 1 {
		t.Errorf("replay of the rest: %d replayed", replayed)
	}
	oracle.waitApplied(t, append(append([]string{}, ok...), late[:2]...))
	if n := r.count(); n != 0 {
		t.Errorf("%d dead rows after the replays, want 0", n)
	}
	var rows int
	if err := pool.QueryRow(testenv.Ctx(t), "SELECT count(*) FROM "+ob.Table()+" WHERE id = $1", late[2]).Scan(&rows); err != nil || rows != 0 {
		t.Errorf("the discarded row: %d rows, %v; want deleted", rows, err)
	}
}
