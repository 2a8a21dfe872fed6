// Command outbox shows idem's transactional outbox end to end: orders are
// written together with their events in one PostgreSQL transaction, and a
// relay publishes the committed events to RabbitMQ right after the commit,
// with publisher confirms. A rolled-back order's events are never published.
//
//	go run ./examples/outbox
//	go run ./examples/outbox -postgres postgres://user@host/db -amqp amqp://user:pass@host:5672/
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"

	"github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

func main() {
	var (
		pgURL    = flag.String("postgres", envOr("IDEM_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL URL")
		amqpURL  = flag.String("amqp", envOr("IDEM_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"), "RabbitMQ URL")
		schema   = flag.String("schema", "", "schema for the example's tables, dropped at the end unless -keep (default: a fresh idem_example_outbox_<random>)")
		exchange = flag.String("exchange", "idem.example.orders", "exchange the events are published to")
		orders   = flag.Int("orders", 10, "number of orders to place")
		keep     = flag.Bool("keep", false, "keep the schema, exchange and queue at the end")
	)
	flag.Parse()
	if *schema == "" {
		*schema = fmt.Sprintf("idem_example_outbox_%08x", rand.Uint32())
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	err := run(ctx, *pgURL, *amqpURL, *schema, *exchange, *orders, *keep)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox example:", err)
		os.Exit(1)
	}
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func run(ctx context.Context, pgURL, amqpURL, schema, exchange string, n int, keep bool) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	// PostgreSQL: the outbox table and a business table.
	pool, err := pgxpool.New(ctx, pgURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: schema, Logger: logger})
	if err != nil {
		return err
	}
	if err := ob.Migrate(ctx); err != nil {
		return fmt.Errorf("migrate (is PostgreSQL up? `make up`): %w", err)
	}
	ordersTable := pgx.Identifier{schema, "orders"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+ordersTable+" (id text PRIMARY KEY, total_cents bigint NOT NULL)"); err != nil {
		return err
	}
	if !keep {
		defer func() {
			_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		}()
	}

	// RabbitMQ: the exchange, and a queue standing in for a downstream
	// service.
	queue := exchange + ".audit"
	admin, err := amqp091.Dial(amqpURL)
	if err != nil {
		return fmt.Errorf("RabbitMQ (is it up? `make up`): %w", err)
	}
	defer func() { _ = admin.Close() }()
	ch, err := admin.Channel()
	if err != nil {
		return err
	}
	if err := ch.ExchangeDeclare(exchange, amqp091.ExchangeTopic, true, false, false, false, nil); err != nil {
		return err
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		return err
	}
	if err := ch.QueueBind(queue, "order.#", exchange, false, nil); err != nil {
		return err
	}
	if !keep {
		defer func() {
			_, _ = ch.QueueDelete(queue, false, false, false)
			_ = ch.ExchangeDelete(exchange, false, false)
		}()
	}
	deliveries, err := ch.Consume(queue, "", true, false, false, false, nil)
	if err != nil {
		return err
	}

	// The relay: publishes committed events through the AMQP publisher.
	pub, err := idemamqp.NewPublisher(amqpURL, idemamqp.PublisherOptions{Logger: logger})
	if err != nil {
		return err
	}
	defer func() { _ = pub.Close() }()
	relay, err := pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{Telemetry: consumer.Telemetry{Logger: logger}})
	if err != nil {
		return err
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var relayErr error
	wg.Go(func() { relayErr = relay.Run(relayCtx) })
	defer func() { stopRelay(); wg.Wait() }()

	// Orders: each one and its two events in one transaction. The third
	// order fails after its events were enqueued: its transaction rolls
	// back, and its events never leave.
	var want []string
	for i := 1; i <= n; i++ {
		id := fmt.Sprintf("order-%03d", i)
		// The trace context of the request that places the order (here a
		// made-up traceparent header), as OpenTelemetry's W3C propagator
		// puts it in the request's context.
		reqCtx := propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier{
			outbox.HeaderTraceParent: fmt.Sprintf("00-%032x-%016x-01", i, i),
		})
		ids, err := placeOrder(reqCtx, pool, ob, ordersTable, exchange, id, int64(1000*i), i == 3)
		switch {
		case errors.Is(err, errDeclined):
			fmt.Printf("%s: declined, rolled back (its events are never published)\n", id)
		case err != nil:
			return err
		default:
			want = append(want, ids...)
		}
	}

	// The downstream side: every committed event arrives once the relay
	// published it (the message id is the outbox id, for idem's consumer
	// to deduplicate on).
	got := map[string]bool{}
	for len(got) < len(want) {
		select {
		case d, ok := <-deliveries:
			if !ok {
				return errors.New("consumer channel closed")
			}
			if !got[d.MessageId] {
				got[d.MessageId] = true
				fmt.Printf("received %-13s key %s  id %s  traceparent %v\n", string(d.Body), d.RoutingKey, d.MessageId, d.Headers[outbox.HeaderTraceParent])
			}
		case <-ctx.Done():
			return fmt.Errorf("received %d of %d events: %w", len(got), len(want), ctx.Err())
		}
	}
	stopRelay()
	wg.Wait()
	if relayErr != nil {
		return relayErr
	}
	pending, _, err := ob.Backlog(ctx)
	if err != nil {
		return err
	}
	fmt.Printf("%d orders, %d events committed, %d received, %d still pending in the outbox\n", n, len(want), len(got), pending)
	return nil
}

var errDeclined = errors.New("payment declined")

// placeOrder writes the order and its events in one transaction.
func placeOrder(ctx context.Context, pool *pgxpool.Pool, ob *pgoutbox.Outbox, table, exchange, id string, cents int64, decline bool) ([]string, error) {
	var ids []string
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO "+table+" (id, total_cents) VALUES ($1, $2)", id, cents); err != nil {
			return err
		}
		var err error
		ids, err = ob.Enqueue(ctx, tx,
			outbox.Message{Topic: exchange, Key: []byte("order." + id), Payload: []byte("placed " + id)},
			outbox.Message{Topic: exchange, Key: []byte("order." + id), Payload: []byte("paid " + id)},
		)
		if err != nil {
			return err
		}
		if decline {
			return errDeclined // BeginFunc rolls back
		}
		return nil
	})
	return ids, err
}
