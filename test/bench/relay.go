package bench

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

// The relay rows: each relay (the poll relay, pgoutbox, on the shared
// PostgreSQL; the WAL relay, walrelay, on a throwaway cluster with
// wal_level = logical) drains messages committed before it starts to a
// broker (RabbitMQ with publisher confirms; Kafka, kfake in its own
// process, acks from all replicas), against the bare client publishing the
// same messages the same way, outboxBatch at a time.

// relayOutbox is a fresh outbox of one relay kind.
type relayOutbox struct {
	enqueue  func(ctx context.Context, tx pgx.Tx, msgs ...outbox.Message) ([]string, error)
	pool     *pgxpool.Pool // the outbox's database
	newRelay func(pub outbox.Publisher) (interface{ Run(context.Context) error }, error)
	vacuum   string // a statement run after the enqueue, before the relay starts ("" for none)
	// close, when set, removes what the outbox holds on the server once its
	// relay stopped (the WAL relay's slot: a cluster has few).
	close func(ctx context.Context)
}

// closeAfter runs close, when set, with a context of its own.
func (o *relayOutbox) closeAfter(ctx context.Context) {
	if o.close != nil {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		o.close(cctx)
	}
}

// relayKind is one of the two relays.
type relayKind struct {
	name string // "poll relay (pgoutbox.Relay)"
	open func(ctx context.Context, e *env) (*relayOutbox, error)
}

var pollRelay = relayKind{name: "outbox poll relay (pgoutbox.Relay)", open: func(ctx context.Context, e *env) (*relayOutbox, error) {
	return openPollRelay(ctx, e, pgoutbox.Options{}, 0)
}}

// pollRelayNoNotify is the poll relay without Enqueue's notification,
// polling every 5 ms (a latency row only).
var pollRelayNoNotify = relayKind{name: "outbox poll relay, NoNotify, polling every 5 ms (pgoutbox.Relay)", open: func(ctx context.Context, e *env) (*relayOutbox, error) {
	return openPollRelay(ctx, e, pgoutbox.Options{NoNotify: true}, 5*time.Millisecond)
}}

func openPollRelay(ctx context.Context, e *env, opts pgoutbox.Options, poll time.Duration) (*relayOutbox, error) {
	opts.Schema, opts.Table, opts.Logger = e.schema, testenv.Name("outbox"), e.log
	ob, err := pgoutbox.New(e.pool, opts)
	if err == nil {
		err = ob.Migrate(ctx)
	}
	if err != nil {
		return nil, err
	}
	return &relayOutbox{enqueue: ob.Enqueue, pool: e.pool, vacuum: "VACUUM ANALYZE " + ob.Table(),
		newRelay: func(pub outbox.Publisher) (interface{ Run(context.Context) error }, error) {
			return pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{BatchSize: outboxBatch, CleanupInterval: -1, PollInterval: poll,
				Telemetry: consumer.Telemetry{Logger: e.log}})
		}}, nil
}

var walRelay = relayKind{name: "outbox WAL relay (walrelay.Relay)", open: func(ctx context.Context, e *env) (*relayOutbox, error) {
	pool, err := e.logicalPool(ctx)
	if err != nil {
		return nil, err
	}
	ob, err := walrelay.New(pool, walrelay.Options{Schema: e.schema, Table: testenv.Name("outbox"), Logger: e.log})
	if err == nil {
		err = ob.Migrate(ctx)
	}
	if err != nil {
		return nil, err
	}
	drop := func(ctx context.Context) {
		// A relay that just stopped may hold the slot for a moment.
		for range 100 {
			if err := ob.DropSlot(ctx); !errors.Is(err, walrelay.ErrSlotActive) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		_, _ = pool.Exec(ctx, "DROP PUBLICATION IF EXISTS "+pgx.Identifier{ob.Options().Publication}.Sanitize())
	}
	return &relayOutbox{enqueue: ob.Enqueue, pool: pool, close: drop,
		newRelay: func(pub outbox.Publisher) (interface{ Run(context.Context) error }, error) {
			// Both brokers' publishers are safe for concurrent use, so
			// the relay sends the next batch while the broker confirms
			// one, as `idem relay --source wal` does.
			return walrelay.NewRelay(ob, pub, walrelay.RelayOptions{BatchSize: outboxBatch, PublishesInFlight: 2, CleanupInterval: -1,
				Telemetry: consumer.Telemetry{Logger: e.log}})
		}}, nil
}}

// logicalPool starts the run's logical-replication cluster on first use.
func (e *env) logicalPool(ctx context.Context) (*pgxpool.Pool, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.logical != nil || e.logicalErr != nil {
		return e.logical, e.logicalErr
	}
	pg, err := fault.StartLogicalPostgres(ctx)
	if err != nil {
		e.logicalErr = fmt.Errorf("a throwaway PostgreSQL with wal_level = logical: %w", err)
		return nil, e.logicalErr
	}
	cfg, err := pgxpool.ParseConfig(pg.URL())
	if err != nil {
		_ = pg.Close()
		e.logicalErr = err
		return nil, err
	}
	cfg.MaxConns = 24
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		_, err = pool.Exec(ctx, "CREATE SCHEMA "+e.ident())
	}
	if err != nil {
		_ = pg.Close()
		e.logicalErr = err
		return nil, err
	}
	e.logical = pool
	// Runs after the cleanups registered later (the slots), so last.
	e.cleanups = append(e.cleanups, func(context.Context) { pool.Close(); _ = pg.Close() })
	return pool, nil
}

// relayTarget is one of the two brokers: a destination per row, the bare
// client's side and the relay's publisher.
type relayTarget struct {
	name string
	// dest prepares a destination: the outbox topic (a RabbitMQ exchange, a
	// Kafka topic), and a function that empties it between rounds.
	dest func(ctx context.Context, e *env) (topic string, reset func(), err error)
	// bare publishes n messages to topic with the bare client.
	bare func(ctx context.Context, e *env, topic string, n int) (float64, error)
	// publisher is the relay's publisher, closed by the returned function.
	publisher func(ctx context.Context, e *env) (outbox.Publisher, func(), error)
	// sender is the latency baseline's: it publishes one message to topic
	// with the bare client and returns once the broker confirmed it.
	sender func(ctx context.Context, e *env, topic string) (func(ctx context.Context, id string, key []byte) error, func(), error)
}

var rabbitTarget = relayTarget{
	name:   "RabbitMQ with confirms",
	dest:   func(_ context.Context, e *env) (string, func(), error) { return e.exchange() },
	bare:   outboxBare,
	sender: amqpSender,
	publisher: func(_ context.Context, e *env) (outbox.Publisher, func(), error) {
		p, err := idemamqp.NewPublisher(e.amqpURL, idemamqp.PublisherOptions{Logger: e.log})
		if err != nil {
			return nil, nil, err
		}
		return p, func() { _ = p.Close() }, nil
	},
}

var kafkaTarget = relayTarget{
	name:   "Kafka",
	sender: kafkaSender,
	dest: func(ctx context.Context, e *env) (string, func(), error) {
		k, err := e.broker()
		if err != nil {
			return "", nil, err
		}
		topic, del, err := k.topic(ctx, 0)
		if err != nil {
			del()
			return "", nil, err
		}
		e.onClose(func(context.Context) { del() })
		return topic, func() {}, nil
	},
	bare: func(ctx context.Context, e *env, topic string, n int) (float64, error) {
		k, err := e.broker()
		if err != nil {
			return 0, err
		}
		w := k.writer()
		defer func() { _ = w.Close() }()
		start := time.Now()
		recs := make([]kafkago.Message, 0, outboxBatch)
		for i := range n {
			recs = append(recs, kafkago.Message{Topic: topic, Key: fmt.Append(nil, "key-", i%1000), Value: payload,
				Headers: []kafkago.Header{{Key: outbox.HeaderMessageID, Value: []byte(e.id("m"))}}})
			if len(recs) == cap(recs) || i == n-1 {
				if err := w.WriteMessages(ctx, recs...); err != nil {
					return 0, err
				}
				recs = recs[:0]
			}
		}
		return float64(n) / time.Since(start).Seconds(), nil
	},
	publisher: func(_ context.Context, e *env) (outbox.Publisher, func(), error) {
		k, err := e.broker()
		if err != nil {
			return nil, nil, err
		}
		w := k.writer()
		p, err := idemkafka.NewPublisher(w, idemkafka.PublisherOptions{})
		if err != nil {
			_ = w.Close()
			return nil, nil, err
		}
		return p, func() { _ = w.Close() }, nil
	},
}

// writer is the Kafka writer of both sides: the key's hash picks the
// partition, acks from all replicas, batches of up to outboxBatch sent
// after at most a millisecond.
func (k *kafkaBroker) writer() *kafkago.Writer {
	return &kafkago.Writer{Addr: kafkago.TCP(k.addr), Balancer: &kafkago.Hash{}, RequiredAcks: kafkago.RequireAll,
		BatchSize: outboxBatch, BatchTimeout: time.Millisecond}
}

// relayRow is the throughput row of relay to broker.
func relayRow(relay relayKind, broker relayTarget, target float64) row {
	baseline := "bare amqp091-go publisher with confirms, 500 in flight"
	if broker.name == "Kafka" {
		baseline = "bare kafka-go Writer, WriteMessages of 500, acks from all"
	}
	// Watermill's forwarder is a poll relay too: it runs beside the poll
	// relay, on a destination of its own.
	var peer func(ctx context.Context, e *env) (side, error)
	if relay.name == pollRelay.name {
		peer = func(ctx context.Context, e *env) (side, error) {
			topic, reset, err := broker.dest(ctx, e)
			if err != nil {
				return nil, err
			}
			run := peerSide(e, broker, topic)
			return func(ctx context.Context, warm bool) (float64, error) {
				defer reset()
				return run(ctx, warm)
			}, nil
		}
	}
	return row{
		path:     fmt.Sprintf("%s to %s", relay.name, broker.name),
		baseline: baseline,
		target:   target, unit: "msg/s",
		build: func(ctx context.Context, e *env) (side, side, error) {
			topic, reset, err := broker.dest(ctx, e)
			if err != nil {
				return nil, nil, err
			}
			bare := func(ctx context.Context, warm bool) (float64, error) {
				defer reset()
				return broker.bare(ctx, e, topic, warmed(e.size.deliveries, warm))
			}
			idem := func(ctx context.Context, warm bool) (float64, error) {
				defer reset()
				return drainRelay(ctx, e, relay, broker, topic, warmed(e.size.deliveries, warm))
			}
			return bare, idem, nil
		},
		peer: peer,
	}
}

// drainRelay enqueues n messages into a fresh outbox of relay (untimed),
// then times the relay publishing them to broker, from its first publish
// to the last confirm.
func drainRelay(ctx context.Context, e *env, relay relayKind, broker relayTarget, topic string, n int) (float64, error) {
	ob, err := relay.open(ctx, e)
	if err != nil {
		return 0, err
	}
	defer ob.closeAfter(ctx)
	for i := 0; i < n; i += 1000 {
		var msgs []outbox.Message
		for j := i; j < min(i+1000, n); j++ {
			msgs = append(msgs, outbox.Message{Topic: topic, Key: fmt.Append(nil, "key-", j%1000), Payload: payload})
		}
		if err := pgx.BeginFunc(ctx, ob.pool, func(tx pgx.Tx) error { _, err := ob.enqueue(ctx, tx, msgs...); return err }); err != nil {
			return 0, err
		}
	}
	if ob.vacuum != "" {
		if _, err := ob.pool.Exec(ctx, ob.vacuum); err != nil {
			return 0, err
		}
	}
	p, closePub, err := broker.publisher(ctx, e)
	if err != nil {
		return 0, err
	}
	defer closePub()
	pub := &counting{Publisher: p, want: int64(n), done: make(chan struct{})}
	r, err := ob.newRelay(pub)
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithCancel(ctx)
	errc, stopped := runUntil(ctx, r.Run)
	defer func() { cancel(); <-stopped }()
	select {
	case <-pub.done:
	case err := <-errc:
		return 0, fmt.Errorf("relay stopped: %w", err)
	case <-time.After(10 * time.Minute):
		return 0, fmt.Errorf("relay published %d of %d in 10 minutes", pub.n.Load(), n)
	}
	rate := float64(n) / pub.end.Sub(time.Unix(0, pub.first.Load())).Seconds()
	cancel()
	if err := <-errc; err != nil && !errors.Is(err, context.Canceled) {
		return 0, err
	}
	return rate, nil
}
