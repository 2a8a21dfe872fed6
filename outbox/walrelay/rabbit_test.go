package walrelay_test

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

// Through a real broker: the relay publishes to RabbitMQ with publisher
// confirms (adapters/amqp). Every delivery carries its outbox id as
// message-id and the traceparent of Enqueue's ctx; a message to an
// exchange that does not exist is refused by the broker on every attempt
// and parked, while the others arrive, with two Publish calls in flight.
func TestRelayToRabbitMQ(t *testing.T) {
	t.Parallel()
	sources(t, func(t *testing.T, src walrelay.Source) {
		u, err := url.Parse(testenv.AMQPURL())
		if err != nil {
			t.Fatal(err)
		}
		testenv.RequireTCP(t, "RabbitMQ", u.Host)
		exchange, queue := testenv.Name("idemtest_x"), testenv.Name("idemtest_q")
		conn, err := amqp091.Dial(testenv.AMQPURL())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		if err := ch.ExchangeDeclare(exchange, amqp091.ExchangeTopic, false, true, false, false, nil); err != nil {
			t.Fatal(err)
		}
		if _, err := ch.QueueDeclare(queue, false, true, false, false, nil); err != nil {
			t.Fatal(err)
		}
		if err := ch.QueueBind(queue, "#", exchange, false, nil); err != nil {
			t.Fatal(err)
		}
		deliveries, err := ch.Consume(queue, "", true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}

		pool := logicalPool(t)
		ob := newWAL(t, pool, walrelay.Options{Source: src})
		pub, err := idemamqp.NewPublisher(testenv.AMQPURL(), idemamqp.PublisherOptions{Logger: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		defer pub.Close()
		// Batches of two with two calls in flight: the publisher's
		// channels carry two batches at once, the poison's among them.
		start(t, newRelay(t, ob, pub, walrelay.RelayOptions{MaxAttempts: 2, BatchSize: 2, PublishesInFlight: 2}))

		const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
		ctx := traceCtx(traceparent)
		want := map[string]bool{}
		var poison []string
		for i := range 10 {
			var batch []outbox.Message
			for j := range 20 {
				batch = append(batch, msg(exchange, []string{"a", "b", "c"}[j%3], "payload"))
			}
			if i == 4 {
				batch = append(batch, msg(testenv.Name("idemtest_missing"), "a", "poison"))
			}
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			ids, err := ob.Enqueue(ctx, tx, batch...)
			if err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			for j, id := range ids {
				if batch[j].Topic == exchange {
					want[id] = true
				} else {
					poison = append(poison, id)
				}
			}
		}
		seen := map[string]bool{}
		timeout := time.After(60 * time.Second)
		for len(seen) < len(want) {
			select {
			case d := <-deliveries:
				if !want[d.MessageId] {
					t.Fatalf("delivery with message-id %q, not an enqueued id", d.MessageId)
				}
				if d.Headers[outbox.HeaderTraceParent] != traceparent {
					t.Fatalf("delivery %s: traceparent %v", d.MessageId, d.Headers[outbox.HeaderTraceParent])
				}
				seen[d.MessageId] = true
			case <-timeout:
				t.Fatalf("%d of %d messages arrived", len(seen), len(want))
			}
		}
		var lastErr string
		eventually(t, "the message to a missing exchange parked", func() bool {
			return pool.QueryRow(context.Background(), "SELECT last_error FROM "+ob.DeadTable()+" WHERE id = $1", poison[0]).Scan(&lastErr) == nil
		})
		if !strings.Contains(lastErr, idemamqp.ErrNoExchange.Error()) {
			t.Fatalf("parked with %q, want the broker's refusal (%v)", lastErr, idemamqp.ErrNoExchange)
		}
	})
}
