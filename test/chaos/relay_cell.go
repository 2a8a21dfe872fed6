package chaos

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// Relay SIGKILL cells: the runner enqueues the inputs into a pgoutbox
// outbox (a transaction per batch), two relay child processes publish them
// to the broker, and a consumer in the runner applies each with pgtable's
// Transactional handler, deduplicating on the message id (the outbox row
// id). The relays are SIGKILLed at random and at the named points
// before_publish and after_publish — between the broker's confirm and the
// mark, where the batch is certainly published again. The promise: 0
// duplicate effects and 0 lost, although the relays re-publish.

var relayPoints = []string{pointAfterPub, pointBeforePub}

// relayKeys is the number of ordering keys of the inputs.
const relayKeys = 32

// relaySink is the broker side of a relay cell: the consumer in the runner.
type relaySink interface {
	// configure sets the child's broker fields.
	configure(c *childConfig)
	// topic is the outbox messages' topic (Kafka topic, AMQP exchange).
	topic() string
	// caughtUp reports whether the consumer acknowledged everything the
	// broker holds.
	caughtUp(ctx context.Context, idle time.Duration) (bool, error)
	// settle stops the consumer and checks that nothing is left.
	settle(ctx context.Context) error
}

// relayHandler is the consumer side's handler: pgtable's Transactional
// with the effect in the claim's transaction (taking work longer, in the
// transaction, so that faults find handlers running), and every delivery
// (first attempt) logged to the runner's own deliveries file.
func relayHandler(b *cellBase, logPath string, work time.Duration) (consumer.Handler, func(), error) {
	store, err := pgtable.New(b.pool, pgtable.Options{Schema: b.oracle.Schema(), Logger: quietLogger()})
	if err != nil {
		return nil, nil, err
	}
	f, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, nil, err
	}
	ins := effectSQL(b.oracle.Table())
	inner, err := consumer.Transactional(store, consumer.TxOptions{Scope: b.scope},
		func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			if _, err := tx.Exec(ctx, ins, msg.ID, "consumer"); err != nil {
				return err
			}
			if work > 0 {
				return sleepCtx(ctx, work)
			}
			return nil
		})
	if err != nil {
		_ = f.Close()
		return nil, nil, err
	}
	var mu sync.Mutex
	h := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		if msg.Attempt <= 1 {
			mu.Lock()
			_, _ = f.WriteString(msg.ID + "\n")
			mu.Unlock()
		}
		return inner.Handle(ctx, msg)
	})
	return h, func() { _ = f.Close() }, nil
}

// relayWorkload enqueues inputs into the outbox the relay children publish:
// at a steady pace (relayRate), so that the relays always have work when a
// kill goes off.
type relayWorkload struct {
	b        *cellBase
	ob       *pgoutbox.Outbox
	sink     relaySink
	next     int
	enqueued atomic.Int64
	mu       sync.Mutex
	err      error
	stop     context.CancelFunc
	done     chan struct{}
}

// relayRate is how many inputs per second the runner enqueues.
const relayRate = 500

func newRelayWorkload(ctx context.Context, b *cellBase, sink relaySink) (*relayWorkload, error) {
	ob, err := pgoutbox.New(b.pool, pgoutbox.Options{Schema: b.oracle.Schema(), Logger: quietLogger()})
	if err != nil {
		return nil, err
	}
	if err := ob.Migrate(ctx); err != nil {
		return nil, err
	}
	return &relayWorkload{b: b, ob: ob, sink: sink}, nil
}

func (w *relayWorkload) child() string { return "relay" }

func (w *relayWorkload) logPrefix() string { return "publishes" }

func (w *relayWorkload) config(int) childConfig {
	c := w.b.config()
	w.sink.configure(&c)
	return c
}

// enqueuer writes outbox messages in the caller's transaction:
// pgoutbox.Outbox and walrelay.Outbox.
type enqueuer interface {
	Enqueue(ctx context.Context, tx pgx.Tx, msgs ...outbox.Message) ([]string, error)
}

// enqueue writes ids to the outbox, 100 per transaction.
func enqueue(ctx context.Context, pool *pgxpool.Pool, ob enqueuer, topic string, ids []string, next *int) error {
	for len(ids) > 0 {
		n := min(len(ids), 100)
		msgs := make([]outbox.Message, n)
		for i, id := range ids[:n] {
			msgs[i] = outbox.Message{ID: id, Topic: topic, Key: fmt.Appendf(nil, "k%02d", *next%relayKeys), Payload: []byte(`{"id":"` + id + `"}`)}
			*next++
		}
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			got, err := ob.Enqueue(ctx, tx, msgs...)
			if err == nil && len(got) > 0 && got[0] != ids[0] {
				err = fmt.Errorf("the outbox gave %s the id %s", ids[0], got[0])
			}
			return err
		})
		if err != nil {
			return fmt.Errorf("enqueue: %w", err)
		}
		ids = ids[n:]
	}
	return nil
}

func (w *relayWorkload) produce(ctx context.Context, ids []string) error {
	ctx, w.stop = context.WithCancel(ctx)
	w.done = make(chan struct{})
	go func() {
		defer close(w.done)
		const batch = 10
		t := time.NewTicker(batch * time.Second / relayRate)
		defer t.Stop()
		for len(ids) > 0 {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			n := min(batch, len(ids))
			if err := enqueue(ctx, w.b.pool, w.ob, w.sink.topic(), ids[:n], &w.next); err != nil {
				w.mu.Lock()
				w.err = err
				w.mu.Unlock()
				return
			}
			w.enqueued.Add(int64(n))
			ids = ids[n:]
		}
	}()
	return nil
}

// close stops the producer.
func (w *relayWorkload) close() {
	if w.stop != nil {
		w.stop()
		<-w.done
	}
}

// progress is the number of inputs the relays published (and marked).
func (w *relayWorkload) progress(ctx context.Context) (int, error) {
	w.mu.Lock()
	err := w.err
	w.mu.Unlock()
	if err != nil {
		return 0, err
	}
	n := w.enqueued.Load()
	pending, _, err := w.ob.Backlog(ctx)
	return int(n - pending), err
}

func (w *relayWorkload) drained(ctx context.Context, idle time.Duration) (bool, error) {
	if int(w.enqueued.Load()) < len(w.b.ids) {
		_, err := w.progress(ctx)
		return false, err
	}
	pending, _, err := w.ob.Backlog(ctx)
	if err != nil || pending > 0 {
		return false, err
	}
	return w.sink.caughtUp(ctx, idle)
}

func (w *relayWorkload) settle(ctx context.Context) error {
	pending, _, err := w.ob.Backlog(ctx)
	if err != nil {
		return err
	}
	if pending > 0 {
		return fmt.Errorf("%d outbox rows pending after the relays stopped", pending)
	}
	return w.sink.settle(ctx)
}

// deadRows counts the outbox rows parked as dead: inputs never delivered,
// which the oracle counts as lost.
func deadRows(ctx context.Context, pool *pgxpool.Pool, ob *pgoutbox.Outbox) (n int, err error) {
	err = pool.QueryRow(ctx, "SELECT count(*) FROM "+ob.Table()+" WHERE dead_at IS NOT NULL").Scan(&n)
	return n, err
}

// uuidIDs returns n outbox ids (time-ordered UUIDs).
func uuidIDs(n int) ([]string, error) {
	out := make([]string, n)
	for i := range out {
		u, err := uuid.NewV7()
		if err != nil {
			return nil, err
		}
		out[i] = u.String()
	}
	return out, nil
}

// publisherFunc adapts a function to outbox.Publisher.
type publisherFunc func(ctx context.Context, msgs []*outbox.Message) error

func (f publisherFunc) Publish(ctx context.Context, msgs []*outbox.Message) error {
	return f(ctx, msgs)
}

// relayChild is the relay child: a pgoutbox Relay whose publisher passes
// the kill points around each confirmed batch and logs every message the
// broker confirmed.
func relayChild(ctx context.Context) error {
	r, err := newChildRun(ctx)
	if err != nil {
		return err
	}
	defer r.quit()
	pool, err := childPool(r.ctx, r.cfg.PGURL, 3)
	if err != nil {
		return err
	}
	defer pool.Close()
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: r.cfg.Schema, Logger: childLogger()})
	if err != nil {
		return err
	}
	pub, closer, err := killingPublisher(r)
	if err != nil {
		return err
	}
	defer closer()
	opts := relayOptions(childLogger())
	if r.cfg.DirectURL != "" {
		if opts.ConnConfig, err = pgx.ParseConfig(r.cfg.DirectURL); err != nil {
			return err
		}
	}
	relay, err := pgoutbox.NewRelay(ob, pub, opts)
	if err != nil {
		return err
	}
	r.ready()
	return r.done(relay.Run(r.ctx))
}

// killingPublisher is a relay child's publisher: the broker's (Kafka or
// AMQP, as configured), with the kill points around each batch and every
// message the broker confirmed logged.
func killingPublisher(r *childRun) (outbox.Publisher, func(), error) {
	var (
		pub    outbox.Publisher
		closer func()
		err    error
	)
	switch {
	case len(r.cfg.Brokers) > 0:
		pub, closer, err = relayKafkaPublisher(r.cfg)
	case r.cfg.Exchange != "":
		pub, closer, err = relayAMQPPublisher(r.cfg)
	default:
		err = errors.New("no broker configured")
	}
	if err != nil {
		return nil, nil, err
	}
	return publisherFunc(func(ctx context.Context, msgs []*outbox.Message) error {
		r.kill.at(pointBeforePub)
		if err := pub.Publish(ctx, msgs); err != nil {
			return err
		}
		for _, m := range msgs {
			r.log.record(m.ID)
		}
		r.kill.at(pointAfterPub)
		return nil
	}), closer, nil
}

// relayOptions are the options of every relay of the cells.
func relayOptions(logger *slog.Logger) pgoutbox.RelayOptions {
	return pgoutbox.RelayOptions{
		Telemetry:         consumer.Telemetry{Logger: logger},
		Shards:            8,
		BatchSize:         50,
		PollInterval:      200 * time.Millisecond,
		RebalanceInterval: 300 * time.Millisecond,
		Backoff:           consumer.Backoff{Initial: 100 * time.Millisecond, Max: time.Second},

		ReconnectBackoff: consumer.Backoff{Initial: 50 * time.Millisecond, Max: time.Second},

		CleanupInterval: -1,
		ShutdownTimeout: 5 * time.Second,
		QueryTimeout:    10 * time.Second,
	}
}
