// Command watermill runs a Watermill router on a real broker — watermill-sql
// over PostgreSQL — with idem's middleware, Watermill's Retry, Recoverer and
// PoisonQueue middleware, and idem's outbox:
//
//	go run ./examples/watermill
//	go run ./examples/watermill -postgres postgres://user@host:5432/db -orders 20
//
// Every order is published twice (a producer retry), the charge of one order
// fails on its first attempt (a gateway timeout, retried), and one message
// reuses an order's UUID with another amount (a forged or corrupted message).
// At the end each order is charged once, has one receipt and one email, and
// the forged message is in the poison topic.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"sync"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

func main() {
	var cfg config
	flag.StringVar(&cfg.postgres, "postgres", envOr("IDEM_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test"), "PostgreSQL URL (idem's tables and the watermill-sql broker)")
	flag.StringVar(&cfg.schema, "schema", "", "schema for the example's tables, dropped at the end unless -keep (default: a fresh idem_example_watermill_<random>)")
	flag.IntVar(&cfg.orders, "orders", 10, "number of orders to publish")
	flag.BoolVar(&cfg.keep, "keep", false, "keep the schema at the end")
	flag.Parse()
	if cfg.schema == "" {
		cfg.schema = fmt.Sprintf("idem_example_watermill_%08x", rand.Uint32())
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	sum, err := run(ctx, cfg, os.Stdout)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "watermill example:", err)
		os.Exit(1)
	}
	fmt.Println(sum)
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

type config struct {
	postgres string
	schema   string
	orders   int
	keep     bool
}

// summary is what the run ended with.
type summary struct {
	Orders, Published      int // orders, and messages published to "orders"
	Charges, ChargedTwice  int // rows in charges, orders with more than one
	Receipts, Emails       int // outbox rows, emails sent
	Duplicates             int // deliveries of "orders" acknowledged without running charge
	Poisoned               int // messages in the poison topic
	PoisonReason           string
	ChargeAttempts, Failed int // handler runs of "charge", of which failed
}

func (s summary) String() string {
	return fmt.Sprintf("%d orders, %d messages published: %d charges (%d orders charged twice), %d receipts, %d emails, %d duplicates dropped, %d poisoned (%s); charge ran %d times, %d failed and were retried",
		s.Orders, s.Published, s.Charges, s.ChargedTwice, s.Receipts, s.Emails, s.Duplicates, s.Poisoned, s.PoisonReason, s.ChargeAttempts, s.Failed)
}

type order struct {
	ID     string `json:"id"`
	Amount int64  `json:"amount_cents"`
}

func run(ctx context.Context, cfg config, out io.Writer) (summary, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	var sum summary
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	wmLogger := wm.NewSlogLogger(logger)

	// PostgreSQL for idem: processed_events, the outbox, a charges table.
	// At most 8 + 4 connections, and one for the relay.
	pcfg, err := pgxpool.ParseConfig(cfg.postgres)
	if err != nil {
		return sum, err
	}
	pcfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return sum, err
	}
	defer pool.Close()
	schema := pgx.Identifier{cfg.schema}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+schema); err != nil {
		return sum, fmt.Errorf("create schema (is PostgreSQL up? `make up`): %w", err)
	}
	if !cfg.keep {
		defer func() { _, _ = pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA "+schema+" CASCADE") }()
	}
	store, err := pgtable.New(pool, pgtable.Options{Schema: cfg.schema, Logger: logger})
	if err != nil {
		return sum, err
	}
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: cfg.schema, Logger: logger})
	if err != nil {
		return sum, err
	}
	if err := store.Migrate(ctx); err != nil {
		return sum, err
	}
	if err := ob.Migrate(ctx); err != nil {
		return sum, err
	}
	charges := pgx.Identifier{cfg.schema, "charges"}.Sanitize()
	// No unique constraint: a second charge of an order would show.
	if _, err := pool.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+charges+" (order_id text NOT NULL, amount_cents bigint NOT NULL, charged_at timestamptz NOT NULL DEFAULT clock_timestamp())"); err != nil {
		return sum, err
	}

	// The broker: watermill-sql on the same PostgreSQL, its topic tables in
	// the example's schema.
	ccfg, err := pgx.ParseConfig(cfg.postgres)
	if err != nil {
		return sum, err
	}
	ccfg.RuntimeParams["search_path"] = cfg.schema
	db := stdlib.OpenDB(*ccfg)
	db.SetMaxOpenConns(4)
	defer func() { _ = db.Close() }()
	newPublisher := func() (*wmsql.Publisher, error) {
		return wmsql.NewPublisher(db, wmsql.PublisherConfig{SchemaAdapter: wmsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, wmLogger)
	}
	newSubscriber := func(group string) (*wmsql.Subscriber, error) {
		return wmsql.NewSubscriber(db, wmsql.SubscriberConfig{
			ConsumerGroup:    group,
			SchemaAdapter:    wmsql.DefaultPostgreSQLSchema{},
			OffsetsAdapter:   wmsql.DefaultPostgreSQLOffsetsAdapter{},
			InitializeSchema: true,
			PollInterval:     100 * time.Millisecond,
			ResendInterval:   100 * time.Millisecond,
			RetryInterval:    100 * time.Millisecond,
		}, wmLogger)
	}
	producer, err := newPublisher()
	if err != nil {
		return sum, err
	}
	defer func() { _ = producer.Close() }()

	// The outbox relay publishes committed receipts to the broker.
	relayPub, err := newPublisher()
	if err != nil {
		return sum, err
	}
	defer func() { _ = relayPub.Close() }()
	pub, err := idemwatermill.NewPublisher(relayPub)
	if err != nil {
		return sum, err
	}
	relay, err := pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{Shards: 1, PollInterval: 200 * time.Millisecond, CleanupInterval: -1, Telemetry: consumer.Telemetry{Logger: logger}})
	if err != nil {
		return sum, err
	}
	relayCtx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(relayCtx) }()
	defer func() {
		stopRelay()
		if err := <-relayDone; err != nil {
			logger.Warn("relay", "error", err)
		}
	}()

	var (
		mu       sync.Mutex
		emails   = map[string]int{}
		poisoned []*message.Message
		done     = make(chan struct{})
	)
	// finished is called with mu held.
	finished := func() {
		if len(emails) == cfg.orders && len(poisoned) == 1 {
			close(done)
		}
	}

	// The router. Outermost first: what still fails after the retries
	// goes to the poison topic; Retry does not retry poison (idem's
	// Retryable); Recoverer turns a panic into an error after idem gave the
	// key back.
	poisonPub, err := newPublisher()
	if err != nil {
		return sum, err
	}
	poisonQueue, err := middleware.PoisonQueue(poisonPub, "poison")
	if err != nil {
		return sum, err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, wmLogger)
	if err != nil {
		return sum, err
	}
	router.AddMiddleware(
		poisonQueue,
		middleware.Retry{
			MaxRetries:      5,
			InitialInterval: 50 * time.Millisecond,
			MaxInterval:     time.Second,
			Multiplier:      2,
			ShouldRetry:     func(p middleware.RetryParams) bool { return idemwatermill.Retryable(p.Err) },
		}.Middleware,
		middleware.Recoverer,
	)

	// charge: in PostgreSQL, exactly once. The claim, the charge and the
	// receipt (written to the outbox) commit in one transaction.
	txMW, err := idemwatermill.Transactional(store, idemwatermill.Options{
		Outbox: ob,
		Telemetry: consumer.Telemetry{
			Logger: logger,
			OnOutcome: func(_ context.Context, r consumer.Report) {
				if r.Outcome == consumer.OutcomeDuplicate {
					_, _ = fmt.Fprintf(out, "charge: %s delivered again, acknowledged without charging\n", r.Key.ID)
					mu.Lock()
					sum.Duplicates++
					mu.Unlock()
				}
			},
		},
	})
	if err != nil {
		return sum, err
	}
	chargeSub, err := newSubscriber("billing")
	if err != nil {
		return sum, err
	}
	chargeOut, err := newPublisher() // closed by the router; the outbox publishes
	if err != nil {
		return sum, err
	}
	failFor := ""
	router.AddHandler("charge", "orders", chargeSub, "receipts", chargeOut, func(msg *message.Message) ([]*message.Message, error) {
		var o order
		if err := json.Unmarshal(msg.Payload, &o); err != nil {
			return nil, err
		}
		mu.Lock()
		sum.ChargeAttempts++
		fail := failFor == "" && o.ID == "order-002"
		if fail {
			failFor = o.ID
			sum.Failed++
		}
		mu.Unlock()
		ctx := msg.Context()
		if _, err := idemwatermill.Tx[pgx.Tx](ctx).Exec(ctx, "INSERT INTO "+charges+" (order_id, amount_cents) VALUES ($1, $2)", o.ID, o.Amount); err != nil {
			return nil, err
		}
		if fail { // after the write: it rolls back with the claim
			_, _ = fmt.Fprintf(out, "charge %s: payment gateway timeout, rolled back, retried\n", o.ID)
			return nil, errors.New("payment gateway timeout")
		}
		receipt, _ := json.Marshal(map[string]any{"order": o.ID, "amount_cents": o.Amount})
		_, _ = fmt.Fprintf(out, "charge %s: %d cents\n", o.ID, o.Amount)
		return []*message.Message{message.NewMessage(wm.NewUUID(), receipt)}, nil
	}).AddMiddleware(txMW)

	// email: an effect outside the database, under a lease in the same
	// processed_events table (pgtable's lease mode).
	leaseMW, err := idemwatermill.Dedup(store.Lease(), idemwatermill.Options{Telemetry: consumer.Telemetry{Logger: logger}})
	if err != nil {
		return sum, err
	}
	mailSub, err := newSubscriber("mailer")
	if err != nil {
		return sum, err
	}
	router.AddConsumerHandler("email", "receipts", mailSub, func(msg *message.Message) error {
		var r struct {
			Order string `json:"order"`
		}
		if err := json.Unmarshal(msg.Payload, &r); err != nil {
			return err
		}
		_, _ = fmt.Fprintf(out, "email %s: receipt %s sent\n", r.Order, msg.UUID)
		mu.Lock()
		emails[r.Order]++
		finished()
		mu.Unlock()
		return nil
	}).AddMiddleware(leaseMW)

	opsSub, err := newSubscriber("ops")
	if err != nil {
		return sum, err
	}
	router.AddConsumerHandler("poison-log", "poison", opsSub, func(msg *message.Message) error {
		_, _ = fmt.Fprintf(out, "poison %s: %s (%s)\n", msg.UUID, msg.Payload, msg.Metadata.Get(consumer.HeaderReason))
		mu.Lock()
		poisoned = append(poisoned, msg)
		finished()
		mu.Unlock()
		return nil
	})

	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-routerDone:
		return sum, err
	}
	closeRouter := func() error {
		err := router.Close()
		if rerr := <-routerDone; err == nil {
			err = rerr
		}
		return err
	}

	// Produce: each order twice (same UUID), then a forged copy of the
	// first order (same UUID, another amount).
	var first *message.Message
	for i := 1; i <= cfg.orders; i++ {
		body, _ := json.Marshal(order{ID: fmt.Sprintf("order-%03d", i), Amount: int64(1000 * i)})
		msg := message.NewMessage(wm.NewUUID(), body)
		if first == nil {
			first = msg
		}
		for range 2 {
			if err := producer.Publish("orders", msg.Copy()); err != nil {
				_ = closeRouter()
				return sum, err
			}
			sum.Published++
		}
	}
	forged := message.NewMessage(first.UUID, []byte(`{"id":"order-001","amount_cents":999999}`))
	if err := producer.Publish("orders", forged); err != nil {
		_ = closeRouter()
		return sum, err
	}
	sum.Published++

	select {
	case <-done:
	case <-ctx.Done():
		_ = closeRouter()
		return sum, fmt.Errorf("not finished: %w", ctx.Err())
	}
	// The last handlers have returned; give their subscribers a moment to
	// commit the acks before the router closes them (an ack cut short is
	// harmless — the message comes back and is a duplicate — but logged).
	time.Sleep(300 * time.Millisecond)
	if err := closeRouter(); err != nil {
		return sum, err
	}

	sum.Orders = cfg.orders
	if err := pool.QueryRow(ctx, "SELECT count(*), count(*) - count(DISTINCT order_id) FROM "+charges).Scan(&sum.Charges, &sum.ChargedTwice); err != nil {
		return sum, err
	}
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+ob.Table()).Scan(&sum.Receipts); err != nil {
		return sum, err
	}
	mu.Lock()
	defer mu.Unlock()
	for _, n := range emails {
		sum.Emails += n
	}
	sum.Poisoned = len(poisoned)
	if len(poisoned) > 0 {
		sum.PoisonReason = poisoned[0].Metadata.Get(consumer.HeaderReason)
	}
	return sum, nil
}
