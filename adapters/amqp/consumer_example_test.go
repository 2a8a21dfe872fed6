package idemamqp_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/memstore"
)

// A worker charging orders from a RabbitMQ queue, once per message id. The
// producer publishes order-1 twice (a relay that crashed between publishing
// and marking does that) and a message without id. The dedup lease (in
// memory here; redisnx or pgtable in production) turns the second order-1
// into an acknowledged duplicate; the message without id cannot be
// deduplicated and goes to the dead-letter queue with reason invalid_key.
func ExampleNewConsumer() {
	const url = "amqp://guest:guest@127.0.0.1:5672/"
	queue := "idem-example-" + strings.ToLower(rand.Text()[:8])

	store, err := memstore.New(memstore.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()
	dedupMW, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "billing/charge"})
	if err != nil {
		fmt.Println(err)
		return
	}
	charge := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		fmt.Printf("charged %s: %s\n", msg.ID, msg.Payload)
		return nil
	})
	h := consumer.Chain(charge, consumer.Recover(), dedupMW)

	settled := make(chan struct{}, 16)
	c, err := idemamqp.NewConsumer(url, queue, h, idemamqp.ConsumerOptions{
		Prefetch:    100,
		Concurrency: 1,
		Backoff:     consumer.Backoff{Initial: time.Second, Max: time.Second}, // one retry queue: <queue>.retry.1000ms
		NotDurable:  true,                                                     // a throw-away queue for the example
		Telemetry: consumer.Telemetry{
			OnOutcome: func(context.Context, consumer.Report) {
				settled <- struct{}{}
			},
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer deleteExampleTopology(url, queue)
	select {
	case <-c.Ready(): // the queues are declared
	case err := <-done:
		cancel()
		fmt.Println(err)
		return
	}

	if err := publishExample(url, queue,
		amqp091.Publishing{MessageId: "order-1", Body: []byte("42.00 EUR")},
		amqp091.Publishing{MessageId: "order-1", Body: []byte("42.00 EUR")},
		amqp091.Publishing{Body: []byte("no id")},
	); err != nil {
		cancel()
		fmt.Println(err)
		return
	}
	for range 3 {
		<-settled
	}
	cancel() // graceful stop
	if err := <-done; err != nil {
		fmt.Println(err)
	}
	st := c.Stats()
	fmt.Printf("acked %d (%d duplicate), dead-lettered %d\n", st.Acked, st.Duplicates, st.DeadLettered)
	// Output:
	// charged order-1: 42.00 EUR
	// acked 2 (1 duplicate), dead-lettered 1
}

func publishExample(url, queue string, msgs ...amqp091.Publishing) error {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := ch.Confirm(false); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, m := range msgs {
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, m)
		if err != nil {
			return err
		}
		ok, err := dc.WaitContext(ctx)
		if err != nil {
			return fmt.Errorf("publish: %w", err)
		}
		if !ok {
			return fmt.Errorf("publish %s: nacked by the broker", m.MessageId)
		}
	}
	return nil
}

func deleteExampleTopology(url, queue string) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	for _, q := range []string{queue, queue + ".dlq", queue + ".retry.1000ms"} {
		_, _ = ch.QueueDelete(q, false, false, false)
	}
	_ = ch.ExchangeDelete(queue+".dlx", false, false)
}

// A loop of one's own over amqp091-go deliveries, keeping its own Ack:
// NewMessage maps each delivery, consumer.Process runs the dedup chain, and
// the Result's Action says whether to ack. The producer publishes order-1
// twice and a message without id: the second order-1 is a duplicate,
// acknowledged without charging again; the message without id cannot be
// deduplicated and is dead-lettered (here only printed).
func ExampleNewMessage() {
	const url = "amqp://guest:guest@127.0.0.1:5672/"
	queue := "idem-example-loop-" + strings.ToLower(rand.Text()[:8])

	store, err := memstore.New(memstore.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()
	dedupMW, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "billing/charge"})
	if err != nil {
		fmt.Println(err)
		return
	}
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		fmt.Printf("charged %s: %s\n", msg.ID, msg.Payload)
		return nil
	}), consumer.Recover(), dedupMW)

	conn, err := amqp091.Dial(url)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		fmt.Println(err)
		return
	}
	// A throw-away queue for the example: deleted when its consumer goes.
	if _, err := ch.QueueDeclare(queue, false, true, false, false, nil); err != nil {
		fmt.Println(err)
		return
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := publishExample(url, queue,
		amqp091.Publishing{MessageId: "order-1", Body: []byte("42.00 EUR")},
		amqp091.Publishing{MessageId: "order-1", Body: []byte("42.00 EUR")},
		amqp091.Publishing{Body: []byte("no id")},
	); err != nil {
		fmt.Println(err)
		return
	}

	ctx := context.Background()
	for range 3 {
		d := <-deliveries
		// What idem needs in the loop:
		msg, err := idemamqp.NewMessage(&d, idemamqp.MessageOptions{Queue: queue})
		r := consumer.Decide(err) // an id header that is not a string: dead-letter it
		if err == nil {
			r = consumer.Process(ctx, h, msg)
		}
		switch r.Action {
		case consumer.ActionAck:
			if r.Duplicate {
				fmt.Printf("duplicate %s acknowledged\n", msg.ID)
			}
			_ = d.Ack(false)
		case consumer.ActionDeadLetter:
			// Publish it to a dead-letter queue (with confirms), then ack.
			fmt.Printf("dead letter: %s\n", r.Reason)
			_ = d.Ack(false)
		default: // ActionRetry: back to the queue (better: a delayed retry)
			_ = d.Nack(false, true)
		}
	}
	// Output:
	// charged order-1: 42.00 EUR
	// duplicate order-1 acknowledged
	// dead letter: invalid_key
}
