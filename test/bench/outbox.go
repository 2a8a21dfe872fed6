package bench

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
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
