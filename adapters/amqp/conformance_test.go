package idemamqp_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"slices"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/adapters/adaptertest"
	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestConformance runs the adapter conformance suite on the Consumer, on a
// classic queue and on a quorum queue of the test RabbitMQ. The Consumer
// runs one handler at a time, but its retries go through retry queues,
// so a retried message comes back after the messages published after it:
// the broker promises no order.
func TestConformance(t *testing.T) {
	t.Parallel()
	t.Run("classic", func(t *testing.T) { adaptertest.Run(t, newAMQPHarness(false)) })
	t.Run("quorum", func(t *testing.T) { adaptertest.Run(t, newAMQPHarness(true)) })
}

// amqpIDHeader carries the ids longer than the 255 bytes an AMQP
// message-id property holds; shorter ids travel as the message-id.
const amqpIDHeader = "x-idem-message-id"

// amqpHarness is the RabbitMQ adapter's adaptertest.Harness.
type amqpHarness struct {
	quorum bool

	mu  sync.Mutex
	dls map[string][]adaptertest.DeadLetter // read from each dead-letter queue so far
}

func newAMQPHarness(quorum bool) *amqpHarness {
	return &amqpHarness{quorum: quorum, dls: map[string][]adaptertest.DeadLetter{}}
}

func (h *amqpHarness) Capabilities() adaptertest.Capabilities {
	return adaptertest.Capabilities{Ordering: adaptertest.OrderNone, ChildProcess: true, Parallel: true}
}

func (h *amqpHarness) queueArgs() amqp091.Table {
	if h.quorum {
		return amqp091.Table{"x-queue-type": "quorum"}
	}
	return nil
}

// amqpAdmin runs f on a channel of a fresh connection.
func amqpAdmin(rawURL string, f func(ch *amqp091.Channel) error) error {
	conn, err := amqp091.Dial(rawURL)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	return f(ch)
}

func (h *amqpHarness) NewDestination(t testing.TB, opts adaptertest.ConsumerOptions) adaptertest.Destination {
	t.Helper()
	rawURL := testenv.AMQPURL()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	testenv.RequireTCP(t, "RabbitMQ", u.Host)
	q := testenv.Name("idemconf")
	if err := amqpAdmin(rawURL, func(ch *amqp091.Channel) error {
		_, err := ch.QueueDeclare(q, true, false, false, false, h.queueArgs())
		return err
	}); err != nil {
		t.Fatalf("declare %s: %v", q, err)
	}
	t.Cleanup(func() {
		_ = amqpAdmin(rawURL, func(ch *amqp091.Channel) error {
			_, _ = ch.QueueDelete(q, false, false, false)
			_, _ = ch.QueueDelete(q+".dlq", false, false, false)
			names, _ := idemamqp.RetryQueues(q, idemamqp.ConsumerOptions{Backoff: opts.Backoff})
			for _, name := range names {
				_, _ = ch.QueueDelete(name, false, false, false)
			}
			return ch.ExchangeDelete(q+".dlx", false, false)
		})
	})
	return adaptertest.Destination{Name: q, DeadLetter: q + ".dlq", Params: map[string]string{"url": rawURL}}
}

func (h *amqpHarness) Publish(ctx context.Context, d adaptertest.Destination, msgs ...adaptertest.Message) error {
	return amqpAdmin(d.Params["url"], func(ch *amqp091.Channel) error {
		if err := ch.Confirm(false); err != nil {
			return err
		}
		for _, m := range msgs {
			p := amqp091.Publishing{DeliveryMode: amqp091.Persistent, Body: m.Payload, Headers: amqp091.Table{}}
			for k, v := range m.Headers {
				p.Headers[k] = v
			}
			if len(m.ID) > 255 {
				p.Headers[amqpIDHeader] = m.ID
			} else {
				p.MessageId = m.ID
			}
			dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", d.Name, true, false, p)
			if err != nil {
				return err
			}
			ok, err := dc.WaitContext(ctx)
			if err != nil {
				return err
			}
			if !ok {
				return fmt.Errorf("the broker nacked a message to %s", d.Name)
			}
		}
		return nil
	})
}

func (h *amqpHarness) Start(ctx context.Context, d adaptertest.Destination, w adaptertest.Work, opts adaptertest.ConsumerOptions) (adaptertest.Consumer, error) {
	u, err := url.Parse(d.Params["url"])
	if err != nil {
		return nil, err
	}
	port := u.Port()
	if port == "" {
		port = "5672"
	}
	proxy, err := fault.NewProxy(net.JoinHostPort(u.Hostname(), port))
	if err != nil {
		return nil, err
	}
	u.Host = proxy.Addr()
	c, err := idemamqp.NewConsumer(u.String(), d.Name, w.Handler, idemamqp.ConsumerOptions{
		QuorumQueue:      h.quorum,
		QueueArgs:        h.queueArgs(),
		IDHeader:         amqpIDHeader,
		Prefetch:         20,
		Backoff:          opts.Backoff,
		MaxAttempts:      opts.MaxAttempts,
		ReconnectBackoff: consumer.Backoff{Initial: 20 * time.Millisecond, Max: 500 * time.Millisecond},
		Telemetry:        consumer.Telemetry{Logger: slog.New(slog.DiscardHandler)},
	})
	if err != nil {
		_ = proxy.Close()
		return nil, err
	}
	rctx, cancel := context.WithCancel(context.Background())
	ac := &amqpConsumer{c: c, proxy: proxy, cancel: cancel, done: make(chan error, 1)}
	go func() { ac.done <- c.Run(rctx) }()
	select {
	case <-c.Ready():
		return ac, nil
	case err := <-ac.done:
		cancel()
		_ = proxy.Close()
		return nil, fmt.Errorf("Run returned before consuming: %w", err)
	case <-ctx.Done():
		cancel()
		runErr := <-ac.done
		_ = proxy.Close()
		return nil, fmt.Errorf("%w before the consumer was ready (Run: %w)", ctx.Err(), runErr)
	}
}

type amqpConsumer struct {
	c      *idemamqp.Consumer
	proxy  *fault.Proxy // between the Consumer and the broker
	cancel context.CancelFunc
	done   chan error
}

func (c *amqpConsumer) Stop(ctx context.Context) error {
	c.cancel()
	defer func() { _ = c.proxy.Close() }()
	select {
	case err := <-c.done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("the consumer did not stop: %w", ctx.Err())
	}
}

// Interrupt resets the Consumer's connection in the proxy and waits until
// it connected again.
func (c *amqpConsumer) Interrupt(ctx context.Context) error {
	before := c.c.Stats().Connects
	if c.proxy.ResetAll() == 0 {
		return fmt.Errorf("the proxy had no connection to reset")
	}
	for c.c.Stats().Connects <= before {
		select {
		case <-ctx.Done():
			return fmt.Errorf("the consumer did not reconnect: %w", ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}

// DeadLetters takes what is in the dead-letter queue and returns it with
// everything taken before.
func (h *amqpHarness) DeadLetters(_ context.Context, d adaptertest.Destination) ([]adaptertest.DeadLetter, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	err := amqpAdmin(d.Params["url"], func(ch *amqp091.Channel) error {
		for {
			m, ok, err := ch.Get(d.DeadLetter, true)
			if err != nil || !ok {
				return err
			}
			dl := adaptertest.DeadLetter{ID: m.MessageId, Payload: m.Body, Headers: map[string]string{}}
			for k, v := range m.Headers {
				dl.Headers[k] = fmt.Sprint(v)
			}
			dl.Reason = dl.Headers[consumer.HeaderReason]
			switch n := m.Headers[idemamqp.HeaderAttempt].(type) {
			case int32:
				dl.Attempts = int(n)
			case int64:
				dl.Attempts = int(n)
			case int:
				dl.Attempts = n
			}
			h.dls[d.DeadLetter] = append(h.dls[d.DeadLetter], dl)
		}
	})
	if err != nil {
		var ae *amqp091.Error
		if !asAMQPError(err, &ae) || ae.Code != amqp091.NotFound {
			return nil, err
		}
	}
	return slices.Clone(h.dls[d.DeadLetter]), nil
}

func asAMQPError(err error, target **amqp091.Error) bool {
	e, ok := err.(*amqp091.Error) //nolint:errorlint // amqp091 returns it unwrapped
	if ok {
		*target = e
	}
	return ok
}
