// Command nats-worker is a payment worker on NATS JetStream: for each order
// of a stream it writes a payment row in PostgreSQL, in the transaction
// that claims the order's message id (consumer.Transactional on pgtable),
// and acknowledges the message only after that committed.
//
// The demo creates a stream, publishes orders (some of them twice with the
// same Nats-Msg-Id, as a relay that crashed between publishing and marking
// would; one malformed; one that fails once), runs the worker until every
// message is settled, prints what happened and deletes the stream and the
// schema. See README.md.
package main

import (
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	idemnats "github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
)

type config struct {
	natsURL  string
	pgURL    string
	stream   string
	n        int
	keep     bool
	out      io.Writer
	deadline time.Duration
}

func main() {
	var cfg config
	flag.StringVar(&cfg.natsURL, "nats", "nats://127.0.0.1:4222", "NATS URL (JetStream enabled)")
	flag.StringVar(&cfg.pgURL, "postgres", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable", "PostgreSQL URL: the payments and the claims")
	flag.StringVar(&cfg.stream, "stream", "", "stream to create (default: a fresh ORDERS_<random>)")
	flag.IntVar(&cfg.n, "n", 50, "orders to publish")
	flag.BoolVar(&cfg.keep, "keep", false, "keep the streams (and the dead letters) and the schema at the end")
	flag.Parse()
	cfg.out = os.Stdout
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	err := run(ctx, cfg)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "nats-worker:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg config) error {
	if cfg.stream == "" {
		cfg.stream = "ORDERS_" + strings.ToUpper(rand.Text()[:8])
	}
	if cfg.deadline == 0 {
		cfg.deadline = time.Minute
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.deadline)
	defer cancel()
	nc, err := nats.Connect(cfg.natsURL, nats.MaxReconnects(-1), nats.Name("nats-worker"))
	if err != nil {
		return fmt.Errorf("NATS at %s is unreachable: %w", cfg.natsURL, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, cfg.pgURL)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		return fmt.Errorf("PostgreSQL is unreachable: %w", err)
	}
	defer pool.Close()

	// The producer's stream, and the worker's schema.
	subject := cfg.stream + ".orders.created"
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: cfg.stream, Subjects: []string{cfg.stream + ".orders.>"}}); err != nil {
		return fmt.Errorf("create stream %s: %w", cfg.stream, err)
	}
	schema := strings.ToLower(cfg.stream)
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema+"; CREATE TABLE "+schema+".payments (order_id text NOT NULL, amount numeric NOT NULL)"); err != nil {
		return err
	}
	if !cfg.keep {
		defer func() {
			_ = js.DeleteStream(context.Background(), cfg.stream)
			_ = js.DeleteStream(context.Background(), cfg.stream+"-dlq")
			_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
		}()
	}

	// The worker.
	store, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	var failedOnce atomic.Bool
	charge, err := consumer.Transactional(store, consumer.TxOptions{Scope: "billing/charge"},
		func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			amount, err := strconv.ParseFloat(string(msg.Payload), 64)
			if err != nil {
				return consumer.Permanent(fmt.Errorf("malformed amount: %w", err))
			}
			if msg.ID == "order-7" && failedOnce.CompareAndSwap(false, true) {
				return errors.New("payment provider timed out") // transient: retried
			}
			_, err = tx.Exec(ctx, "INSERT INTO "+schema+".payments VALUES ($1, $2)", msg.ID, amount)
			return err
		})
	if err != nil {
		return err
	}
	c, err := idemnats.NewConsumer(js, cfg.stream, "billing", consumer.Chain(charge, consumer.Recover()), idemnats.ConsumerOptions{
		Concurrency: 8,
		Backoff:     consumer.Backoff{Initial: 100 * time.Millisecond, Max: time.Second},
	})
	if err != nil {
		return err
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	select {
	case <-c.Ready():
	case err := <-done:
		return err
	}

	// The producer: every tenth order twice, one malformed.
	dropped := 0
	for i := range cfg.n {
		id := fmt.Sprintf("order-%d", i)
		body := fmt.Sprintf("%d.00", 10+i)
		if i == 3 {
			body = "three euros"
		}
		for range 1 + btoi(i%10 == 0) {
			ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: subject, Data: []byte(body), Header: nats.Header{nats.MsgIdHdr: []string{id}}})
			if err != nil {
				return err
			}
			if ack.Duplicate {
				dropped++
			}
		}
	}
	_, _ = fmt.Fprintf(cfg.out, "published %d orders to %s: %d of them twice (the stream dropped %d copies), 1 malformed\n",
		cfg.n, cfg.stream, (cfg.n+9)/10, dropped)

	for {
		st := c.Stats()
		if st.Acked+st.DeadLettered >= int64(cfg.n) {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not every order settled: %+v", st)
		case <-time.After(20 * time.Millisecond):
		}
	}
	stop()
	if err := <-done; err != nil {
		return err
	}
	var payments int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+schema+".payments").Scan(&payments); err != nil {
		return err
	}
	st := c.Stats()
	_, _ = fmt.Fprintf(cfg.out, "%d payments (one per well-formed order); %d retried, %d dead-lettered to %s.dlq\n",
		payments, st.Retried, st.DeadLettered, cfg.stream)
	return nil
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
