package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strconv"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
)

// The demo on RabbitMQ (--amqp): the relay publishes to a fanout exchange
// named after the run, through adapters/amqp's Publisher (publisher
// confirms); each pipeline's consumer reads its own queue bound to it,
// through adapters/amqp's Consumer. As on Kafka, where both groups read the
// one topic, each queue gets every message and the consumer skips the other
// pipeline's. The exchange, the queues and the Consumer's retry and
// dead-letter queues are deleted at the end.

// amqpRetryBackoff makes the Consumer's retry delays, 50ms, 250ms and 1s
// (a claim in flight elsewhere is retried through them). They name its
// retry queues, which the demo deletes at the end.
var amqpRetryBackoff = consumer.Backoff{Initial: 50 * time.Millisecond, Max: time.Second, Factor: 5}

// redactAMQP hides the credentials of a RabbitMQ URL.
func redactAMQP(rawURL string) string {
	u, err := amqp091.ParseURI(rawURL)
	if err != nil {
		return "(the --amqp URL)"
	}
	return fmt.Sprintf("%s:%d%s", u.Host, u.Port, vhostPath(u.Vhost))
}

func vhostPath(vhost string) string {
	if vhost == "" || vhost == "/" {
		return "/"
	}
	return "/" + vhost
}

// setupAMQP declares the run's exchange and queues on the broker at rawURL
// and returns the broker with a Publisher to the exchange. Closing it
// deletes them.
func setupAMQP(ctx context.Context, rawURL, runID string, logger *slog.Logger) (*demoBroker, error) {
	if _, err := amqp091.ParseURI(rawURL); err != nil {
		return nil, fmt.Errorf("--amqp: %w", err)
	}
	where := redactAMQP(rawURL)
	exchange := "idem-demo-payments-" + runID
	b := &demoBroker{
		kind:    brokerAMQP,
		topic:   exchange,
		amqpURL: rawURL,
		queues: map[string]string{
			pathNaive: exchange + ".billing-naive",
			pathIdem:  exchange + ".billing-idem",
		},
		describe: fmt.Sprintf("RabbitMQ at %s, fanout exchange %s and a queue per consumer", where, exchange),
	}
	ok := false
	defer func() {
		if !ok {
			b.close()
		}
	}()
	dialTimeout := 10 * time.Second
	if d, ok := ctx.Deadline(); ok {
		dialTimeout = min(dialTimeout, time.Until(d))
	}
	conn, err := dialAMQP(rawURL, dialTimeout)
	if err != nil {
		return nil, amqpDialError(where, err)
	}
	defer func() { _ = conn.CloseDeadline(time.Now().Add(2 * time.Second)) }()
	b.closers = append(b.closers, func() { deleteAMQPTopology(rawURL, exchange, b.queues) })
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("RabbitMQ at %s: open channel: %w", where, err)
	}
	defer func() { _ = ch.Close() }()
	// Transient: the run's topology lives as long as the run. The
	// queues are declared and bound before anything is published, so no
	// message goes unrouted; the Consumers declare them again, with the
	// same arguments (ConsumerOptions.NotDurable).
	if err := ch.ExchangeDeclare(exchange, amqp091.ExchangeFanout, false, false, false, false, nil); err != nil {
		return nil, fmt.Errorf("RabbitMQ at %s: declare exchange %s: %w", where, exchange, err)
	}
	for _, q := range b.queues {
		if _, err := ch.QueueDeclare(q, false, false, false, false, nil); err != nil {
			return nil, fmt.Errorf("RabbitMQ at %s: declare queue %s: %w", where, q, err)
		}
		if err := ch.QueueBind(q, "", exchange, false, nil); err != nil {
			return nil, fmt.Errorf("RabbitMQ at %s: bind queue %s: %w", where, q, err)
		}
	}
	pub, err := idemamqp.NewPublisher(rawURL, idemamqp.PublisherOptions{
		ConnectionName:   "idem-demo-relay",
		ConfirmTimeout:   5 * time.Second,
		ReconnectBackoff: consumer.Backoff{Initial: 50 * time.Millisecond, Max: time.Second},
		Logger:           logger,
	})
	if err != nil {
		return nil, err
	}
	b.closers = append(b.closers, func() { _ = pub.Close() })
	b.pub = &seqPublisher{pub: pub, exchange: exchange}
	ok = true
	return b, nil
}

// amqpDialError says why a connection to the broker at where failed: the
// broker answered and refused the login or the virtual host, or it did not
// answer at all.
func amqpDialError(where string, err error) error {
	var ae *amqp091.Error
	code := 0
	if errors.As(err, &ae) {
		code = ae.Code
	}
	switch {
	case errors.Is(err, amqp091.ErrVhost) || code == amqp091.NotAllowed:
		return fmt.Errorf("RabbitMQ at %s refused the virtual host: it does not exist or the user may not use it (the path of --amqp names it): %w", where, err)
	case errors.Is(err, amqp091.ErrCredentials) || code == amqp091.AccessRefused:
		return fmt.Errorf("RabbitMQ at %s refused the login: check the user name and password in --amqp (or IDEM_AMQP_URL): %w", where, err)
	}
	return fmt.Errorf("RabbitMQ at %s is unreachable: %w", where, err)
}

// dialAMQP opens the demo's own connection, for the topology.
func dialAMQP(rawURL string, timeout time.Duration) (*amqp091.Connection, error) {
	return amqp091.DialConfig(rawURL, amqp091.Config{
		Dial:       amqp091.DefaultDial(timeout),
		Heartbeat:  10 * time.Second,
		Properties: amqp091.Table{"connection_name": "idem-demo-topology"},
	})
}

// deleteAMQPTopology deletes the run's exchange and queues, with the
// Consumers' retry queues, dead-letter exchanges and dead-letter queues, on
// a connection of its own. Deleting what does not exist is no error; a
// failure (the broker gone) leaves the rest, transient, to the broker.
func deleteAMQPTopology(rawURL, exchange string, queues map[string]string) {
	conn, err := dialAMQP(rawURL, 5*time.Second)
	if err != nil {
		return
	}
	defer func() { _ = conn.CloseDeadline(time.Now().Add(2 * time.Second)) }()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	defer func() { _ = ch.Close() }()
	for _, q := range queues {
		names := []string{q, q + ".dlq"}
		retry, err := idemamqp.RetryQueues(q, idemamqp.ConsumerOptions{Backoff: amqpRetryBackoff})
		if err != nil {
			return
		}
		names = append(names, retry...)
		for _, n := range names {
			if _, err := ch.QueueDelete(n, false, false, false); err != nil {
				return
			}
		}
		if err := ch.ExchangeDelete(q+".dlx", false, false); err != nil {
			return
		}
	}
	_ = ch.ExchangeDelete(exchange, false, false)
}

// seqPublisher sends the relay's messages to the exchange, each copy with a
// sequence number of its own in headerPublish: RabbitMQ has no offsets, and
// the number tells a broker redelivery of a copy (same number) from a
// re-publish (a new number, the same message id).
type seqPublisher struct {
	pub      outbox.Publisher
	exchange string
	seq      atomic.Int64
}

func (p *seqPublisher) Publish(ctx context.Context, msgs []*outbox.Message) error {
	out := make([]*outbox.Message, len(msgs))
	for i, m := range msgs {
		c := *m
		c.Headers = make(map[string]string, len(m.Headers)+1)
		maps.Copy(c.Headers, m.Headers)
		c.Headers[headerPublish] = strconv.FormatInt(p.seq.Add(1), 10)
		if c.Topic == "" {
			c.Topic = p.exchange
		}
		out[i] = &c
	}
	return p.pub.Publish(ctx, out)
}

// amqpConsumerOptions are the options of a pipeline's Consumer.
func amqpConsumerOptions(name, exchange string, logger *slog.Logger) idemamqp.ConsumerOptions {
	return idemamqp.ConsumerOptions{
		ConnectionName:   name,
		Prefetch:         200,
		Concurrency:      4,
		NotDurable:       true,
		Bindings:         []idemamqp.ConsumerBinding{{Exchange: exchange}},
		Backoff:          amqpRetryBackoff,
		MaxAttempts:      10,
		PublishTimeout:   5 * time.Second,
		ShutdownTimeout:  time.Second,
		ReconnectBackoff: consumer.Backoff{Initial: 50 * time.Millisecond, Max: time.Second},
		Telemetry: consumer.Telemetry{
			Logger: logger,
		},
	}
}

// runAMQPInstance runs one instance of the group's Consumer until ctx ends
// or it crashes. A crash happens after a delivery's handler succeeded and
// before the Consumer acknowledges it: the instance closes the delivery's
// channel, so the broker requeues the delivery and every other one the
// channel held unacknowledged, as it does when a worker process dies, and
// the instance stops. The next instance gets them again.
func (g *group) runAMQPInstance(ctx context.Context, inst *instance) error {
	h := g.handler()
	// The instance's own connection: closing it is the crash. The broker
	// requeues every delivery the connection held unacknowledged, as it
	// does when a worker process dies.
	conn, err := amqp091.DialConfig(g.br.amqpURL, amqp091.Config{Properties: amqp091.Table{"connection_name": g.name}})
	if err != nil {
		return fmt.Errorf("amqp: connect: %w", err)
	}
	defer func() { _ = conn.Close() }()
	crashing := consumer.HandlerFunc(func(hctx context.Context, msg *consumer.Message) error {
		err := h.Handle(hctx, msg)
		if err != nil || msg.Headers[headerPath] != g.path || inst.dead.Load() || g.rng.Float64() >= g.crashRate {
			return err
		}
		if inst.dead.Swap(true) {
			return nil
		}
		g.crashes.Add(1)
		// Closed before the handler returns: the ACK that would follow
		// cannot be sent.
		_ = conn.Close()
		inst.cancel()
		return nil
	})
	opts := amqpConsumerOptions(g.name, g.br.topic, g.logger)
	opts.OnOutcome = func(_ context.Context, r consumer.Report) {
		// What the broker got an ACK for is done, even from a worker
		// that raced the crash: it is never delivered again. The
		// others come back (ActionRetry).
		if a := r.Result.Action; a == consumer.ActionAck || a == consumer.ActionDeadLetter {
			g.markHandled(deliveryID(r.Message))
		}
	}
	c, err := idemamqp.NewConsumerConn(conn, g.br.queues[g.path], crashing, opts)
	if err != nil {
		return err
	}
	err = c.Run(ctx)
	if inst.dead.Load() && errors.Is(err, idemamqp.ErrConnectionClosed) {
		return nil // the crash closed it
	}
	return err
}
