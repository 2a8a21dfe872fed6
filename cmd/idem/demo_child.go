package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	kafkago "github.com/segmentio/kafka-go"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/redisnx"
)

// The idem consumer as a child process of the demo (--postgres, --redis).
// The demo starts its own executable again with demoChildEnv set (see
// init below: it works for the idem binary and for a test binary alike),
// writes the childConfig as one JSON line to the child's stdin, and reads
// what the child reports on its stdout, one line per event, each written
// with one write call, so that a SIGKILL loses none that happened:
//
//	d PO ID PAYMENT REQUEST  a delivery of an idem record (PO: copyID.String)
//	c PAYMENT CENTS          a charge, with --redis (with --postgres the
//	                         charges are rows in the oracle table)
//	h PO OWN                 a record handled, about to be acknowledged
//	                         (OWN 1: an idem record)
//	frozen                   the answer to freeze
//
// On its stdin, after the configuration, the demo writes "freeze" to have
// the child stop between deliveries before it is SIGKILLed (with a lease
// store); EOF, when the demo stops it or dies, stops the child gracefully,
// as SIGTERM and SIGINT do.

// demoChildEnv, set to "1", makes the process the demo's consumer child.
const demoChildEnv = "IDEM_DEMO_CHILD"

// The child's pool: the demo's own holds pgMaxConns more.
const childPGConns = 4

// childConfig is what a child needs to run the idem consumer.
type childConfig struct {
	Broker string `json:"broker"` // brokerKafka or brokerAMQP
	Group  string `json:"group"`  // consumer group, and connection name
	Path   string `json:"path"`   // the pipeline whose records it handles

	Brokers   []string `json:"brokers,omitempty"`
	Topic     string   `json:"topic,omitempty"`
	DLQ       string   `json:"dlq,omitempty"`
	SessionMS int64    `json:"session_ms,omitempty"`

	AMQPURL  string `json:"amqp,omitempty"`
	Queue    string `json:"queue,omitempty"`
	Exchange string `json:"exchange,omitempty"`

	Postgres string `json:"postgres,omitempty"`
	Schema   string `json:"schema,omitempty"`
	Redis    string `json:"redis,omitempty"`
	Prefix   string `json:"prefix,omitempty"`
	TTLMS    int64  `json:"ttl_ms,omitempty"` // the marks' TTL in Redis (--dedup-ttl)
}

// childLease is the lease of a child's redisnx store.
const childLease = 5 * time.Second

func init() {
	if os.Getenv(demoChildEnv) != "1" {
		return
	}
	os.Exit(demoChild(os.Stdin, os.Stdout, os.Stderr))
}

// demoChild runs the child until its stdin ends or a signal stops it, and
// returns its exit status.
func demoChild(stdin io.Reader, stdout, stderr io.Writer) int {
	in := bufio.NewReader(stdin)
	line, err := in.ReadBytes('\n')
	if err != nil && len(line) == 0 {
		fprintf(stderr, "idem demo child: no configuration on stdin: %v\n", err)
		return 2
	}
	var cfg childConfig
	if err := json.Unmarshal(line, &cfg); err != nil {
		fprintf(stderr, "idem demo child: configuration: %v\n", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	c := &child{cfg: cfg, out: stdout, logger: slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
	// The goroutine ends with the process: reading stdin cannot be
	// interrupted.
	go func() {
		sc := bufio.NewScanner(in)
		for sc.Scan() {
			if sc.Text() == "freeze" {
				go c.freeze()
			}
		}
		cancel()
	}()
	if err := c.run(ctx); err != nil {
		fprintf(stderr, "idem demo child: %v\n", err)
		return 1
	}
	return 0
}

// child is the consumer child's state.
type child struct {
	cfg    childConfig
	logger *slog.Logger
	// gate is held shared by every running handler; freeze takes it.
	gate sync.RWMutex
	mu   sync.Mutex // one line at a time on out
	out  io.Writer
}

// emit writes one report line with one write call.
func (c *child) emit(fields ...any) {
	line := fmt.Sprintln(fields...)
	c.mu.Lock()
	_, _ = io.WriteString(c.out, line)
	c.mu.Unlock()
}

// freeze waits for the running handlers to finish, holds the next ones
// back, and reports "frozen": the demo SIGKILLs the process between two
// deliveries, never between a charge and the Complete of its lease.
func (c *child) freeze() {
	c.gate.Lock() // never unlocked: the process is about to die
	c.emit("frozen")
}

// outermost holds the gate while the handler runs, and reports a record
// handled when the chain's verdict is not a retry, before the consumer
// acknowledges it (ACK, offset commit): a SIGKILL between the two makes the
// broker deliver the record again, which the demo then counts as a
// redelivery. Reported after the ACK, a record killed in between would be
// acknowledged and never reported.
func (c *child) outermost(next consumer.Handler) consumer.Handler {
	return consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		c.gate.RLock()
		defer c.gate.RUnlock()
		err := next.Handle(ctx, msg)
		if consumer.Decide(err).Action != consumer.ActionRetry {
			c.handled(msg)
		}
		return err
	})
}

// handled reports msg as handled.
func (c *child) handled(msg *consumer.Message) {
	own := 0
	if msg.Headers[headerPath] == c.cfg.Path {
		own = 1
	}
	c.emit("h", deliveryID(msg), own)
}

// run builds the handler chain on the configured store and runs the
// consumer until ctx ends.
func (c *child) run(ctx context.Context) error {
	cfg := c.cfg
	var inner consumer.Handler
	switch {
	case cfg.Postgres != "":
		pcfg, err := pgxpool.ParseConfig(cfg.Postgres)
		if err != nil {
			return err
		}
		pcfg.MaxConns = childPGConns
		pool, err := pgxpool.NewWithConfig(ctx, pcfg)
		if err != nil {
			return err
		}
		defer pool.Close()
		store, err := pgDemoStore(pool, cfg.Schema)
		if err != nil {
			return err
		}
		inner, err = chargeTxHandler(store, pgx.Identifier{cfg.Schema, pgChargesTable}.Sanitize())
		if err != nil {
			return err
		}
	case cfg.Redis != "":
		if cfg.TTLMS <= 0 {
			return errors.New("demo child: no TTL for the Redis marks")
		}
		opt, err := redisOptions(cfg.Redis)
		if err != nil {
			return err
		}
		opt.PoolSize = 8
		client := redis.NewClient(opt)
		defer func() { _ = client.Close() }()
		// A short lease: a claim of this process outlives it only
		// when it was killed without a freeze (a freeze that timed
		// out), and then holds the redelivery back for this long.
		store, err := redisnx.New(client, redisnx.Options{Prefix: cfg.Prefix, TTL: time.Duration(cfg.TTLMS) * time.Millisecond, Lease: childLease})
		if err != nil {
			return err
		}
		dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: chargeScope, Telemetry: consumer.Telemetry{Logger: c.logger}})
		if err != nil {
			return err
		}
		charge := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
			var p paymentBody
			if err := json.Unmarshal(msg.Payload, &p); err != nil {
				return consumer.Permanent(err)
			}
			c.emit("c", p.Payment, p.Cents) // the effect
			return nil
		})
		inner = consumer.Chain(charge, dd)
	default:
		return errors.New("no store: --postgres or --redis")
	}
	delivered := func(msg *consumer.Message, p *paymentBody) {
		req := msg.Headers[headerRequest]
		if req == "" {
			req = "-"
		}
		c.emit("d", deliveryID(msg), msg.ID, p.Payment, req)
	}
	h := consumer.Chain(inner, c.outermost, route(cfg.Path, delivered), consumer.Recover())

	switch cfg.Broker {
	case brokerKafka:
		session := time.Duration(cfg.SessionMS) * time.Millisecond
		kc, err := idemkafka.NewConsumer(kafkago.ReaderConfig{
			Brokers:           cfg.Brokers,
			GroupID:           cfg.Group,
			Topic:             cfg.Topic,
			MinBytes:          1,
			MaxBytes:          10 << 20,
			MaxWait:           50 * time.Millisecond,
			HeartbeatInterval: session / 10,
			SessionTimeout:    session,
			RebalanceTimeout:  2 * session,
			JoinGroupBackoff:  100 * time.Millisecond,
			ReadBackoffMin:    10 * time.Millisecond,
			ReadBackoffMax:    100 * time.Millisecond,
		}, h, idemkafka.ConsumerOptions{
			DeadLetterTopic: cfg.DLQ,
			CommitEvery:     200,
			CommitInterval:  200 * time.Millisecond,
			Backoff:         consumer.Backoff{Initial: 20 * time.Millisecond, Max: 500 * time.Millisecond},
			Telemetry: consumer.Telemetry{
				Logger: c.logger,
			},
		})
		if err != nil {
			return err
		}
		return kc.Run(ctx)
	case brokerAMQP:
		ac, err := idemamqp.NewConsumer(cfg.AMQPURL, cfg.Queue, h, amqpConsumerOptions(cfg.Group, cfg.Exchange, c.logger))
		if err != nil {
			return err
		}
		return ac.Run(ctx)
	}
	return fmt.Errorf("unknown broker %q", cfg.Broker)
}
