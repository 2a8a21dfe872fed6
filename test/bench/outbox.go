package bench

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// outboxBatch is how many messages both sides have in flight at once: the
// relay's batch, the bare publisher's window of unconfirmed messages.
const outboxBatch = 500

// counting is an outbox.Publisher that counts the messages confirmed and
// times them from its first batch on, so that the relay's start (its
// connections, the first poll) is not counted, as the bare publisher's
// connection is not.
type counting struct {
	outbox.Publisher
	n     atomic.Int64
	first atomic.Int64 // UnixNano of the first Publish
	want  int64
	done  chan struct{}
	end   time.Time
}

func (c *counting) Publish(ctx context.Context, msgs []*outbox.Message) error {
	c.first.CompareAndSwap(0, time.Now().UnixNano())
	err := c.Publisher.Publish(ctx, msgs)
	var pe *outbox.PublishError
	ok := int64(len(msgs))
	if errors.As(err, &pe) {
		ok -= int64(len(pe.Failed))
	} else if err != nil {
		ok = 0
	}
	if total := c.n.Add(ok); total >= c.want && total-ok < c.want {
		c.end = time.Now()
		close(c.done)
	}
	return err
}

// exchange declares a durable topic exchange bound to a durable queue,
// both deleted at the end, and returns a function that purges the queue.
func (e *env) exchange() (string, func(), error) {
	x, q := testenv.Name("idembench_x"), testenv.Name("idembench_q")
	err := e.amqp(func(ch *amqp091.Channel) error {
		if err := ch.ExchangeDeclare(x, amqp091.ExchangeTopic, true, false, false, false, nil); err != nil {
			return err
		}
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			return err
		}
		return ch.QueueBind(q, "#", x, false, nil)
	})
	e.onClose(func(context.Context) {
		_ = e.amqp(func(ch *amqp091.Channel) error {
			_, _ = ch.QueueDelete(q, false, false, false)
			return ch.ExchangeDelete(x, false, false)
		})
	})
	purge := func() { _ = e.amqp(func(ch *amqp091.Channel) error { _, err := ch.QueuePurge(q, false); return err }) }
	return x, purge, err
}

func outboxRow() row {
	return row{
		path:     "outbox poll relay to RabbitMQ with confirms (pgoutbox.Relay)",
		baseline: "bare amqp091-go publisher with confirms, 500 in flight",
		target:   0.70, unit: "msg/s",
		build: func(ctx context.Context, e *env) (side, side, error) {
			x, purge, err := e.exchange()
			if err != nil {
				return nil, nil, err
			}
			bare := func(ctx context.Context, warm bool) (float64, error) {
				defer purge()
				return outboxBare(ctx, e, x, warmed(e.size.deliveries, warm))
			}
			idem := func(ctx context.Context, warm bool) (float64, error) {
				defer purge()
				return outboxRelay(ctx, e, x, warmed(e.size.deliveries, warm))
			}
			return bare, idem, nil
		},
	}
}

func outboxBare(ctx context.Context, e *env, exchange string, n int) (rate float64, err error) {
	err = e.amqp(func(ch *amqp091.Channel) error {
		if err := ch.Confirm(false); err != nil {
			return err
		}
		start := time.Now()
		dcs := make([]*amqp091.DeferredConfirmation, 0, outboxBatch)
		for i := range n {
			dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, exchange, fmt.Sprint("key-", i%1000), true, false, amqp091.Publishing{
				DeliveryMode: amqp091.Persistent, MessageId: e.id("m"), Timestamp: time.Now(), Body: payload})
			if err != nil {
				return err
			}
			if dcs = append(dcs, dc); len(dcs) == cap(dcs) || i == n-1 {
				if err := waitConfirms(ctx, dcs); err != nil {
					return err
				}
				dcs = dcs[:0]
			}
		}
		rate = float64(n) / time.Since(start).Seconds()
		return nil
	})
	return rate, err
}

// outboxRelay enqueues n messages into a fresh outbox (untimed), then times
// a relay publishing them.
func outboxRelay(ctx context.Context, e *env, exchange string, n int) (float64, error) {
	ob, err := pgoutbox.New(e.pool, pgoutbox.Options{Schema: e.schema, Table: testenv.Name("outbox"), Logger: e.log})
	if err != nil {
		return 0, err
	}
	if err := ob.Migrate(ctx); err != nil {
		return 0, err
	}
	for i := 0; i < n; i += 1000 {
		var msgs []outbox.Message
		for j := i; j < min(i+1000, n); j++ {
			msgs = append(msgs, outbox.Message{Topic: exchange, Key: fmt.Append(nil, "key-", j%1000), Payload: payload})
		}
		if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { _, err := ob.Enqueue(ctx, tx, msgs...); return err }); err != nil {
			return 0, err
		}
	}
	if _, err := e.pool.Exec(ctx, "VACUUM ANALYZE "+ob.Table()); err != nil {
		return 0, err
	}
	amqpPub, err := idemamqp.NewPublisher(e.amqpURL, idemamqp.PublisherOptions{Logger: e.log})
	if err != nil {
		return 0, err
	}
	defer func() { _ = amqpPub.Close() }()
	pub := &counting{Publisher: amqpPub, want: int64(n), done: make(chan struct{})}
	r, err := pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{BatchSize: outboxBatch, CleanupInterval: -1, Telemetry: consumer.Telemetry{Logger: e.log}})
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- r.Run(ctx) }()
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
