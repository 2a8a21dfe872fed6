package chaos

import (
	"context"
	"errors"
	"fmt"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
)

// AMQP SIGKILL cells: adapters/amqp consumer children on one queue of the
// shared RabbitMQ, fed through a fanout exchange by the runner with
// adapters/amqp's outbox Publisher (confirms; the message id is the input).

// amqpRetryBackoff makes the consumers' retry delays, 100ms and 500ms:
// short, for redisnx's in-flight retries after a kill (the lease runs out
// in leaseMS).
var amqpRetryBackoff = consumer.Backoff{Initial: 100 * time.Millisecond, Max: 500 * time.Millisecond, Factor: 5}

// errDeadLettered: the consumers dead-lettered messages, which never happens
// to the cells' inputs unless something is wrong.
var errDeadLettered = errors.New("messages were dead-lettered")

// amqpQueue is a work queue of a cell and the exchange that feeds it.
type amqpQueue struct {
	url      string // with the vhost
	vhost    string
	queue    string
	exchange string // fanout, bound to queue
	durable  bool
	ctl      *rabbitCtl
}

// queues are the queues the adapters/amqp Consumer declares for q.
func (q *amqpQueue) queues() []string {
	out := []string{q.queue, q.queue + ".dlq"}
	retry, err := idemamqp.RetryQueues(q.queue, idemamqp.ConsumerOptions{Backoff: amqpRetryBackoff})
	if err != nil {
		panic(err) // amqpRetryBackoff is valid
	}
	return append(out, retry...)
}

// dial opens a channel (with its connection) on the broker.
func (q *amqpQueue) dial() (*amqp091.Connection, *amqp091.Channel, error) {
	conn, err := amqp091.DialConfig(q.url, amqp091.Config{Dial: amqp091.DefaultDial(10 * time.Second), Properties: amqp091.Table{"connection_name": "idem-chaos-runner"}})
	if err != nil {
		return nil, nil, fmt.Errorf("RabbitMQ at %s: %w", q.url, err)
	}
	ch, err := conn.Channel()
	if err != nil {
		_ = conn.Close()
		return nil, nil, err
	}
	return conn, ch, nil
}

// declare declares the exchange and the queue and binds them, so that
// inputs published before a consumer connects are routed.
func (q *amqpQueue) declare() error {
	conn, ch, err := q.dial()
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	if err := ch.ExchangeDeclare(q.exchange, amqp091.ExchangeFanout, q.durable, false, false, false, nil); err != nil {
		return err
	}
	if _, err := ch.QueueDeclare(q.queue, q.durable, false, false, false, nil); err != nil {
		return err
	}
	return ch.QueueBind(q.queue, "", q.exchange, false, nil)
}

// remove deletes the queues and exchanges of q (best effort).
func (q *amqpQueue) remove() {
	conn, ch, err := q.dial()
	if err != nil {
		return
	}
	defer func() { _ = conn.Close() }()
	for _, name := range q.queues() {
		if _, err := ch.QueueDelete(name, false, false, false); err != nil {
			if ch, err = conn.Channel(); err != nil {
				return
			}
		}
	}
	for _, x := range []string{q.exchange, q.queue + ".dlx"} {
		if err := ch.ExchangeDelete(x, false, false); err != nil {
			if ch, err = conn.Channel(); err != nil {
				return
			}
		}
	}
}

// ready returns the ready messages of each of q's queues (a queue not
// declared yet counts 0).
func (q *amqpQueue) ready() (map[string]int, error) {
	conn, ch, err := q.dial()
	if err != nil {
		return nil, err
	}
	defer func() { _ = conn.Close() }()
	out := map[string]int{}
	for _, name := range q.queues() {
		qi, err := ch.QueueDeclarePassive(name, q.durable, false, false, false, nil)
		var ae *amqp091.Error
		switch {
		case err == nil:
			out[name] = qi.Messages
		case errors.As(err, &ae) && ae.Code == amqp091.NotFound:
			if ch, err = conn.Channel(); err != nil {
				return nil, err
			}
		default:
			return nil, err
		}
	}
	return out, nil
}

// empty reports whether every queue of q has no ready message; when deep
// is set it asks rabbitmqctl too, which also counts the unacknowledged
// ones. It returns a description of what is left.
func (q *amqpQueue) empty(ctx context.Context, deep bool) (bool, string, error) {
	ready, err := q.ready()
	if err != nil {
		return false, "", err
	}
	if n := ready[q.queue+".dlq"]; n > 0 {
		return false, "", fmt.Errorf("%w: %d in %s.dlq", errDeadLettered, n, q.queue)
	}
	for name, n := range ready {
		if n > 0 {
			return false, fmt.Sprintf("%d ready in %s", n, name), nil
		}
	}
	if !deep {
		return true, "", nil
	}
	depths, err := q.ctl.queueDepths(ctx, q.vhost)
	if err != nil {
		return false, "", err
	}
	for _, name := range q.queues() {
		if d := depths[name]; d[0]+d[1] > 0 {
			return false, fmt.Sprintf("%d ready and %d unacknowledged in %s", d[0], d[1], name), nil
		}
	}
	return true, "", nil
}

// publishAll publishes ids to q's exchange through pub until the broker
// confirmed every one, sending again what failed or whose outcome is
// unknown (a copy may then arrive twice: the consumer's claim drops it). It
// returns how many batches had to be sent again.
func publishAll(ctx context.Context, pub *idemamqp.Publisher, exchange string, ids []string) (resent int, err error) {
	const batch = 200
	for len(ids) > 0 {
		n := min(batch, len(ids))
		msgs := make([]*outbox.Message, n)
		for i, id := range ids[:n] {
			msgs[i] = &outbox.Message{ID: id, Topic: exchange, Payload: []byte("payload-" + id)}
		}
		backoff := 50 * time.Millisecond
		for len(msgs) > 0 {
			perr := pub.Publish(ctx, msgs)
			if perr == nil {
				break
			}
			resent++
			var pe *outbox.PublishError
			if errors.As(perr, &pe) {
				left := make([]*outbox.Message, 0, len(pe.Failed))
				for i := range msgs {
					if _, failed := pe.Failed[i]; failed {
						left = append(left, msgs[i])
					}
				}
				msgs = left
			}
			if err := sleepCtx(ctx, backoff); err != nil {
				return resent, fmt.Errorf("publish: %w (last error: %w)", err, perr)
			}
			backoff = min(2*backoff, time.Second)
		}
		ids = ids[n:]
	}
	return resent, nil
}

// amqpWorkload feeds a queue consumed by amqp-consumer children.
type amqpWorkload struct {
	b   *cellBase
	q   *amqpQueue
	pub *idemamqp.Publisher
}

func newAMQPWorkload(b *cellBase) (*amqpWorkload, func(), error) {
	ctl, err := newRabbitCtl(b.env.AMQPURL)
	if err != nil {
		return nil, nil, err
	}
	q := &amqpQueue{url: b.env.AMQPURL, vhost: vhostOf(b.env.AMQPURL), queue: "chaos." + b.suffix, exchange: "chaos." + b.suffix + ".in", ctl: ctl}
	if err := q.declare(); err != nil {
		return nil, nil, err
	}
	pub, err := idemamqp.NewPublisher(q.url, idemamqp.PublisherOptions{ConnectionName: "idem-chaos-producer", Logger: quietLogger()})
	if err != nil {
		q.remove()
		return nil, nil, err
	}
	return &amqpWorkload{b: b, q: q, pub: pub}, func() { _ = pub.Close(); q.remove() }, nil
}

func (w *amqpWorkload) child() string { return "amqp-consumer" }

func (w *amqpWorkload) config(int) childConfig {
	c := w.b.config()
	c.AMQPURL, c.Queue, c.Exchange, c.Durable = w.q.url, w.q.queue, w.q.exchange, w.q.durable
	return c
}

func (w *amqpWorkload) produce(ctx context.Context, ids []string) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	_, err := publishAll(ctx, w.pub, w.q.exchange, ids)
	return err
}

func (w *amqpWorkload) progress(ctx context.Context) (int, error) { return w.b.distinctEffects(ctx) }

// drained: every input has an effect (or nothing moved for 3s, so that an
// input acknowledged without an effect shows as lost rather than as a
// stall), and the broker holds no message of the cell's queues, ready or
// unacknowledged.
func (w *amqpWorkload) drained(ctx context.Context, idle time.Duration) (bool, error) {
	done, err := w.progress(ctx)
	if err != nil {
		return false, err
	}
	if done < len(w.b.ids) && idle < 3*time.Second {
		return false, nil
	}
	ok, _, err := w.q.empty(ctx, true)
	return ok, err
}

func (w *amqpWorkload) settle(ctx context.Context) error {
	ok, left, err := w.q.empty(ctx, false)
	if err != nil {
		return err
	}
	if !ok {
		return errors.New(left + " after the consumers stopped")
	}
	return nil
}

// amqpChild is the amqp-consumer child: an adapters/amqp Consumer with the
// cell's handler.
func amqpChild(ctx context.Context) error {
	r, err := newChildRun(ctx)
	if err != nil {
		return err
	}
	defer r.quit()
	pool, err := childPool(r.ctx, r.cfg.PGURL, 5)
	if err != nil {
		return err
	}
	defer pool.Close()
	h, closer, err := brokerHandler(r, pool)
	if err != nil {
		return err
	}
	defer closer()
	c, err := idemamqp.NewConsumer(r.cfg.AMQPURL, r.cfg.Queue, h, amqpConsumerOptions(r.cfg.Name, r.cfg.Exchange, r.cfg.Durable))
	if err != nil {
		return err
	}
	r.ready()
	return r.done(c.Run(r.ctx))
}

// amqpConsumerOptions are the options of every AMQP consumer of the cells.
func amqpConsumerOptions(name, exchange string, durable bool) idemamqp.ConsumerOptions {
	return idemamqp.ConsumerOptions{
		ConnectionName:   name,
		Prefetch:         20,
		Concurrency:      4,
		NotDurable:       !durable,
		Bindings:         []idemamqp.ConsumerBinding{{Exchange: exchange}},
		Backoff:          amqpRetryBackoff,
		MaxAttempts:      10,
		ShutdownTimeout:  5 * time.Second,
		ReconnectBackoff: consumer.Backoff{Initial: 100 * time.Millisecond, Max: time.Second},
		Telemetry: consumer.Telemetry{
			Logger: childLogger(),
		},
	}
}

// amqpCell is an AMQP consumer SIGKILL cell.
func amqpCell(name, store string) Cell {
	return Cell{
		Name:             name,
		ExpectDuplicates: store == storeRedis,
		Run: func(ctx context.Context, env *Env) (Result, error) {
			n, kills := env.Pick(1000, 20000), env.Pick(8, 40)
			return withBase(ctx, env, name, store, n, func(b *cellBase) (Result, error) {
				w, cleanup, err := newAMQPWorkload(b)
				if err != nil {
					return Result{}, err
				}
				defer cleanup()
				return killCell(ctx, b, w, killSpec{
					kills: kills, workers: 2, points: consumerPoints,
					named: 8 * time.Second, limit: time.Duration(env.Pick(90, 600)) * time.Second,
				})
			})
		},
	}
}
