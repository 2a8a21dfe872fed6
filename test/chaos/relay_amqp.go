package chaos

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
)

// relay/amqp/sigkill: outbox -> RabbitMQ through adapters/amqp's Publisher
// (publisher confirms) in the relay children, to a fanout exchange bound to
// the work queue of an adapters/amqp Consumer in the runner.

// amqpSink is the RabbitMQ side of a relay cell (also used by the
// rabbit/... cells, with a durable queue in a vhost of their own): one or
// more adapters/amqp Consumers in the runner.
type amqpSink struct {
	b      *cellBase
	q      *amqpQueue
	cs     []*idemamqp.Consumer
	cancel context.CancelFunc
	done   chan error
}

// newAMQPSink declares q and starts n consumers of it with the relay
// handler, whose transaction takes work longer.
func newAMQPSink(ctx context.Context, b *cellBase, q *amqpQueue, n int, work time.Duration) (*amqpSink, func(), error) {
	if err := q.declare(); err != nil {
		return nil, nil, err
	}
	h, closeLog, err := relayHandler(b, filepath.Join(b.env.TempDir, "deliveries-consumer.log"), work)
	if err != nil {
		return nil, nil, err
	}
	s := &amqpSink{b: b, q: q, done: make(chan error, n)}
	cctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s.cancel = cancel
	fail := func(err error) (*amqpSink, func(), error) {
		_ = s.stop()
		closeLog()
		return nil, nil, err
	}
	for i := range n {
		opts := amqpConsumerOptions(fmt.Sprintf("idem-chaos-consumer-%d", i), q.exchange, q.durable)
		opts.Logger = quietLogger()
		c, err := idemamqp.NewConsumer(q.url, q.queue, h, opts)
		if err != nil {
			return fail(err)
		}
		s.cs = append(s.cs, c)
		go func() { s.done <- c.Run(cctx) }()
	}
	for _, c := range s.cs {
		select {
		case <-c.Ready():
		case <-time.After(30 * time.Second):
			return fail(errors.New("a consumer did not start within 30s"))
		}
	}
	return s, func() { _ = s.stop(); closeLog() }, nil
}

// stop stops the consumers (once) and returns the first error of their Run.
func (s *amqpSink) stop() error {
	if s.cancel == nil {
		return nil
	}
	s.cancel()
	s.cancel = nil
	var first error
	timeout := time.After(60 * time.Second)
	for range s.cs {
		select {
		case err := <-s.done:
			if first == nil {
				first = err
			}
		case <-timeout:
			return errors.New("the AMQP consumers did not stop within 60s")
		}
	}
	return first
}

// reconnects is how many times the consumers connected again.
func (s *amqpSink) reconnects() int64 {
	var n int64
	for _, c := range s.cs {
		n += c.Stats().Connects - 1
	}
	return n
}

func (s *amqpSink) configure(c *childConfig) { c.AMQPURL, c.Exchange = s.q.url, s.q.exchange }

func (s *amqpSink) topic() string { return s.q.exchange }

// caughtUp: every input has an effect (or nothing moved for 3s), and the
// broker holds nothing of the cell's queues, ready or unacknowledged.
func (s *amqpSink) caughtUp(ctx context.Context, idle time.Duration) (bool, error) {
	done, err := s.b.distinctEffects(ctx)
	if err != nil {
		return false, err
	}
	if done < len(s.b.ids) && idle < 3*time.Second {
		return false, nil
	}
	ok, _, err := s.q.empty(ctx, true)
	return ok, err
}

func (s *amqpSink) settle(ctx context.Context) error {
	if err := s.stop(); err != nil {
		return fmt.Errorf("consumer: %w", err)
	}
	ok, left, err := s.q.empty(ctx, false)
	if err != nil {
		return err
	}
	if !ok {
		return errors.New(left + " after the consumer stopped")
	}
	return nil
}

// relayAMQPPublisher is the relay child's publisher: adapters/amqp's, with
// publisher confirms.
func relayAMQPPublisher(cfg childConfig) (outbox.Publisher, func(), error) {
	p, err := idemamqp.NewPublisher(cfg.AMQPURL, idemamqp.PublisherOptions{
		ConnectionName: "idem-chaos-" + cfg.Name, ConfirmTimeout: 5 * time.Second,
		ReconnectBackoff: consumer.Backoff{Initial: 50 * time.Millisecond, Max: time.Second}, Logger: childLogger(),
	})
	if err != nil {
		return nil, nil, err
	}
	return p, func() { _ = p.Close() }, nil
}

// relayAMQPCell is relay/amqp/sigkill.
func relayAMQPCell(name string) Cell {
	return Cell{
		Name: name,
		Run: func(ctx context.Context, env *Env) (Result, error) {
			n, kills := env.Pick(1000, 20000), env.Pick(8, 40)
			return withBase(ctx, env, name, storePG, n, func(b *cellBase) (Result, error) {
				ctl, err := newRabbitCtl(env.AMQPURL)
				if err != nil {
					return Result{}, err
				}
				q := &amqpQueue{url: env.AMQPURL, vhost: vhostOf(env.AMQPURL), queue: "chaos." + b.suffix, exchange: "chaos." + b.suffix + ".in", ctl: ctl}
				defer q.remove()
				sink, cleanup, err := newAMQPSink(ctx, b, q, 1, 0)
				if err != nil {
					return Result{}, err
				}
				defer cleanup()
				return relayKillCell(ctx, b, sink, kills)
			})
		},
	}
}

// relayKillCell runs a relay SIGKILL cell over sink.
func relayKillCell(ctx context.Context, b *cellBase, sink relaySink, kills int) (Result, error) {
	ids, err := uuidIDs(len(b.ids))
	if err != nil {
		return Result{}, err
	}
	b.ids = ids
	w, err := newRelayWorkload(ctx, b, sink)
	if err != nil {
		return Result{}, err
	}
	defer w.close()
	res, err := killCell(ctx, b, w, killSpec{
		kills: kills, workers: 2, points: relayPoints,
		named: 8 * time.Second, limit: time.Duration(b.env.Pick(90, 600)) * time.Second,
	})
	pubs, distinct, perr := countDeliveries(b.env.TempDir, "publishes")
	if perr == nil {
		res.Note += fmt.Sprintf("; the broker confirmed %d publishes of %d messages (%d published again; copies sent but unconfirmed at a kill are not counted)", pubs, distinct, pubs-distinct)
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if dead, derr := deadRows(dctx, b.pool, w.ob); derr == nil && dead > 0 {
		res.Note += fmt.Sprintf("; %d outbox rows parked dead", dead)
	}
	return res, err
}
