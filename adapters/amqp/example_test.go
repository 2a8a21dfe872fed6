package idemamqp_test

import (
	"cmp"
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
)

// The services the examples run on.
var (
	exampleAMQPURL     = cmp.Or(os.Getenv("IDEM_TEST_AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
	examplePostgresURL = cmp.Or(os.Getenv("IDEM_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
)

// chargeWorker consumes queue until ctx ends. Each order message inserts a
// row in the application's payments table and claims the message id in
// pgtable's processed_events, in one transaction: both commit or neither
// does. A message delivered again (a redelivery after a crash, a producer
// that published twice) finds its claim and is acknowledged without a
// second charge. onReady, if set, runs once the Consumer consumes: its
// queues are declared, so what is published to queue from then on is
// routed.
func chargeWorker(ctx context.Context, pool *pgxpool.Pool, amqpURL, queue, schema string,
	opts idemamqp.ConsumerOptions, onReady func()) error {
	store, err := pgtable.New(pool, pgtable.Options{Schema: schema, Retention: 14 * 24 * time.Hour})
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil { // creates processed_events
		return err
	}
	payments := pgx.Identifier{schema, "payments"}.Sanitize()
	charge, err := consumer.Transactional(store, consumer.TxOptions{Scope: "billing/charge"},
		func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			// The business write, in the transaction that holds the claim.
			_, err := tx.Exec(ctx, "INSERT INTO "+payments+" (order_id, amount) VALUES ($1, $2)",
				msg.ID, string(msg.Payload))
			return err // an error rolls back the claim too: the retry charges
		})
	if err != nil {
		return err
	}
	c, err := idemamqp.NewConsumer(amqpURL, queue, consumer.Chain(charge, consumer.Recover()), opts)
	if err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	select {
	case <-c.Ready(): // the work, retry and dead-letter queues are declared
		if onReady != nil {
			onReady()
		}
	case err := <-done: // the broker refused the topology or the credentials
		return err
	}
	return <-done // ctx ended: in-flight messages finished and acknowledged
}

// A payment worker whose effect is a row in PostgreSQL (chargeWorker,
// shown in docs/rabbitmq.md): consumer.Transactional on pgtable writes
// the charge and the message's claim in one pgx.Tx. The producer publishes
// order-1 twice, once the worker is Ready: one payment row, and two
// acknowledged deliveries, one of them a duplicate.
func ExampleNewConsumer_transactional() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pool, err := pgxpool.New(ctx, examplePostgresURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	suffix := strings.ToLower(rand.Text()[:8])
	schema, queue := "idem_example_"+suffix, "idem-example-payments-"+suffix
	defer func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	}()
	// The application's own migration.
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()+"; CREATE TABLE "+
		pgx.Identifier{schema, "payments"}.Sanitize()+" (order_id text NOT NULL, amount text NOT NULL)"); err != nil {
		fmt.Println(err)
		return
	}

	var acked, duplicates atomic.Int64
	settled := make(chan struct{}, 16)
	opts := idemamqp.ConsumerOptions{
		Prefetch:    100,
		Concurrency: 8,
		NotDurable:  true, // a throw-away queue for the example
		Telemetry: consumer.Telemetry{
			OnOutcome: func(_ context.Context, r consumer.Report) {
				if r.Result.Action == consumer.ActionAck {
					acked.Add(1)
					if r.Result.Duplicate {
						duplicates.Add(1)
					}
				}
				settled <- struct{}{}
			},
		},
	}
	defer func() {
		if conn, err := amqp091.Dial(exampleAMQPURL); err == nil {
			_ = idemamqp.DeleteTopology(context.Background(), conn, queue, opts)
			_ = conn.Close()
		}
	}()
	published := make(chan error, 1)
	worker := make(chan error, 1)
	go func() {
		worker <- chargeWorker(ctx, pool, exampleAMQPURL, queue, schema, opts, func() {
			published <- publishExample(exampleAMQPURL, queue,
				amqp091.Publishing{MessageId: "order-1", Body: []byte("42.00 EUR")},
				amqp091.Publishing{MessageId: "order-1", Body: []byte("42.00 EUR")})
		})
	}()
	select {
	case err := <-published:
		if err != nil {
			cancel()
			if werr := <-worker; werr != nil {
				fmt.Println(werr)
			}
			fmt.Println(err)
			return
		}
	case err := <-worker:
		fmt.Println("worker:", err)
		return
	}
	for range 2 {
		<-settled
	}
	cancel() // graceful stop
	if err := <-worker; err != nil {
		fmt.Println(err)
	}
	var rows int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{schema, "payments"}.Sanitize()).Scan(&rows); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("payment rows: %d; acknowledged: %d, %d of them as duplicates\n", rows, acked.Load(), duplicates.Load())
	// Output:
	// payment rows: 1; acknowledged: 2, 1 of them as duplicates
}
