// Command kafka is idem's Kafka example: it publishes messages through the
// outbox Publisher, re-publishes some of them (the producer duplicates a relay
// crash causes) and one record without a message id, then consumes them with
// an idem Consumer that applies each message once and dead-letters the
// record it cannot identify.
//
// By default it starts an in-process Kafka (kfake) and keeps the dedup marks
// in memory (memstore). With -brokers it uses a real cluster; with -postgres
// the marks and the effects live in PostgreSQL (pgtable, in the transaction
// of the effect). See README.md.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/outbox"
)

func main() {
	var (
		brokers    = flag.String("brokers", "", "comma-separated Kafka brokers; empty starts an in-process kfake cluster")
		pgURL      = flag.String("postgres", "", "PostgreSQL URL: keep marks and effects there (pgtable) instead of in memory")
		schema     = flag.String("schema", "", "schema for the -postgres tables, kept at the end (default: a fresh idem_example_kafka_<random>, dropped at the end unless -keep)")
		keep       = flag.Bool("keep", false, "keep the fresh schema and its rows at the end")
		n          = flag.Int("n", 1000, "messages to publish")
		dups       = flag.Int("dups", 100, "messages to publish a second time (producer duplicates)")
		partitions = flag.Int("partitions", 4, "partitions of the topic")
		timeout    = flag.Duration("timeout", time.Minute, "give up after this long")
	)
	flag.Parse()
	if err := run(config{brokers: *brokers, postgres: *pgURL, schema: *schema, keep: *keep, n: *n, dups: *dups, partitions: *partitions, timeout: *timeout}); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

// config is the example's flags.
type config struct {
	brokers, postgres, schema string
	keep                      bool
	n, dups, partitions       int
	timeout                   time.Duration
}

func run(cfg config) error {
	brokerList, pgURL, n, dups, partitions, timeout := cfg.brokers, cfg.postgres, cfg.n, cfg.dups, cfg.partitions, cfg.timeout
	if n <= 0 || dups < 0 || dups > n || partitions <= 0 {
		return errors.New("want -n > 0, 0 <= -dups <= -n, -partitions > 0")
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	suffix := randomSuffix()
	topic, dlq, group := "payments-"+suffix, "payments-"+suffix+".dlq", "billing-"+suffix

	// Kafka: the brokers given, or kfake in this process.
	var addrs []string
	if brokerList != "" {
		addrs = strings.Split(brokerList, ",")
		fmt.Printf("kafka: brokers %s\n", brokerList)
	} else {
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
		if err != nil {
			return err
		}
		defer cluster.Close()
		addrs = cluster.ListenAddrs()
		fmt.Printf("kafka: in-process kfake cluster at %s\n", strings.Join(addrs, ","))
	}
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	client := &kafkago.Client{Addr: kafkago.TCP(addrs...), Transport: transport, Timeout: 10 * time.Second}
	if err := createTopics(ctx, client, partitions, topic, dlq); err != nil {
		return err
	}

	// Publish n messages, then re-publish dups of them, then one record
	// without a message id.
	w := &kafkago.Writer{
		Addr:         kafkago.TCP(addrs...),
		Topic:        topic,
		Balancer:     &kafkago.Hash{},
		RequiredAcks: kafkago.RequireAll,
		BatchTimeout: 10 * time.Millisecond,
		Transport:    transport,
	}
	defer func() { _ = w.Close() }()
	pub, err := idemkafka.NewPublisher(w, idemkafka.PublisherOptions{})
	if err != nil {
		return err
	}
	msgs := make([]*outbox.Message, 0, n+dups)
	for i := range n {
		msgs = append(msgs, &outbox.Message{
			ID:      fmt.Sprintf("pay-%s-%06d", suffix, i),
			Key:     []byte("customer-" + strconv.Itoa(i%50)),
			Payload: []byte(strconv.Itoa(100 + i%900)), // the amount, in cents
		})
	}
	msgs = append(msgs, msgs[:dups]...) // a relay that crashed before marking them sent
	if err := pub.Publish(ctx, msgs); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	if err := w.WriteMessages(ctx, kafkago.Message{Key: []byte("customer-x"), Value: []byte("42")}); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	total := int64(len(msgs) + 1)
	fmt.Printf("published %d messages, %d of them again (producer duplicates), and 1 record without a message id\n", n, dups)

	// The handler: charge the amount. In memory, or in PostgreSQL in the
	// transaction of the claim.
	var (
		handler consumer.Handler
		charged func() (rows, ids int, err error)
	)
	if pgURL == "" {
		store, err := memstore.New(memstore.Options{})
		if err != nil {
			return err
		}
		defer func() { _ = store.Close() }()
		dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "billing/charge"})
		if err != nil {
			return err
		}
		var (
			mu      sync.Mutex
			charges = map[string]int{}
		)
		charge := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
			mu.Lock()
			charges[msg.ID]++
			mu.Unlock()
			return nil
		})
		handler = consumer.Chain(charge, consumer.Recover(), dd)
		charged = func() (int, int, error) {
			mu.Lock()
			defer mu.Unlock()
			rows := 0
			for _, c := range charges {
				rows += c
			}
			return rows, len(charges), nil
		}
		fmt.Println("dedup: in memory (memstore)")
	} else {
		pool, err := pgxpool.New(ctx, pgURL)
		if err != nil {
			return err
		}
		defer pool.Close()
		schema := cfg.schema
		if schema == "" {
			schema = "idem_example_kafka_" + suffix
			if !cfg.keep {
				defer func() {
					_, _ = pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
				}()
			}
		}
		store, err := pgtable.New(pool, pgtable.Options{Schema: schema})
		if err != nil {
			return err
		}
		if err := store.Migrate(ctx); err != nil {
			return fmt.Errorf("migrate: %w", err)
		}
		table := pgx.Identifier{schema, "charges"}.Sanitize()
		if _, err := pool.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+table+
			" (payment_id text NOT NULL, amount_cents bigint NOT NULL, at timestamptz NOT NULL DEFAULT now())"); err != nil {
			return err
		}
		handler, err = consumer.Transactional(store, consumer.TxOptions{Scope: "billing/charge"},
			func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
				amount, err := strconv.ParseInt(string(msg.Payload), 10, 64)
				if err != nil {
					return consumer.Permanent(err)
				}
				_, err = tx.Exec(ctx, "INSERT INTO "+table+" (payment_id, amount_cents) VALUES ($1, $2)", msg.ID, amount)
				return err
			})
		if err != nil {
			return err
		}
		handler = consumer.Chain(handler, consumer.Recover())
		charged = func() (rows, ids int, err error) {
			err = pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT payment_id) FROM "+table+" WHERE payment_id LIKE $1",
				"pay-"+suffix+"-%").Scan(&rows, &ids)
			return rows, ids, err
		}
		fmt.Printf("dedup: PostgreSQL (pgtable, schema %s)\n", schema)
	}

	// Consume until every record is acknowledged.
	var acked, duplicates, deadLettered atomic.Int64
	consumed, stop := context.WithCancel(ctx)
	defer stop()
	c, err := idemkafka.NewConsumer(kafkago.ReaderConfig{
		Brokers:  addrs,
		GroupID:  group,
		Topic:    topic,
		MaxWait:  100 * time.Millisecond,
		MinBytes: 1,
		MaxBytes: 10 << 20,
	}, handler, idemkafka.ConsumerOptions{
		DeadLetterTopic: dlq,
		Telemetry: consumer.Telemetry{
			Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})),
			OnOutcome: func(_ context.Context, rep consumer.Report) {
				r := rep.Result
				switch {
				case r.Action == consumer.ActionRetry:
					return
				case r.Duplicate:
					duplicates.Add(1)
				case r.Action == consumer.ActionDeadLetter:
					deadLettered.Add(1)
				}
				if acked.Add(1) == total {
					stop()
				}
			},
		},
	})
	if err != nil {
		return err
	}
	start := time.Now()
	if err := c.Run(consumed); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return fmt.Errorf("timed out after %v with %d of %d records acknowledged", timeout, acked.Load(), total)
	}
	rows, ids, err := charged()
	if err != nil {
		return err
	}
	fmt.Printf("consumed %d records in %v: %d charges, %d duplicates skipped, %d dead-lettered to %s\n",
		acked.Load(), time.Since(start).Round(time.Millisecond), rows, duplicates.Load(), deadLettered.Load(), dlq)
	if rows != n || ids != n {
		return fmt.Errorf("%d charges for %d payments, want %d each once", rows, ids, n)
	}
	fmt.Printf("every payment charged exactly once (%d of %d)\n", ids, n)
	return nil
}

func createTopics(ctx context.Context, client *kafkago.Client, partitions int, topics ...string) error {
	req := &kafkago.CreateTopicsRequest{}
	for i, t := range topics {
		p := partitions
		if i > 0 {
			p = 1
		}
		req.Topics = append(req.Topics, kafkago.TopicConfig{Topic: t, NumPartitions: p, ReplicationFactor: 1})
	}
	res, err := client.CreateTopics(ctx, req)
	if err != nil {
		return fmt.Errorf("create topics: %w", err)
	}
	for t, err := range res.Errors {
		if err != nil && !errors.Is(err, kafkago.TopicAlreadyExists) {
			return fmt.Errorf("create topic %s: %w", t, err)
		}
	}
	// Wait for the leaders (a real cluster elects them asynchronously).
	for {
		md, err := client.Metadata(ctx, &kafkago.MetadataRequest{Topics: topics})
		if err == nil && ready(md) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("topics %v have no leaders: %w", topics, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func ready(md *kafkago.MetadataResponse) bool {
	for _, t := range md.Topics {
		if t.Error != nil || len(t.Partitions) == 0 {
			return false
		}
		for _, p := range t.Partitions {
			if p.Error != nil || p.Leader.Host == "" {
				return false
			}
		}
	}
	return true
}

func randomSuffix() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
