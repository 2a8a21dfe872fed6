package outboxtest

import (
	"context"
	"net/url"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// Rabbit is a test's exchange and queue on RabbitMQ (a topic exchange with
// the queue bound on "#"), deleted when the test ends.
type Rabbit struct {
	t        testing.TB
	URL      string
	Exchange string
	Queue    string
}

// NewRabbit declares the test's exchange and queue on the broker at rawURL
// (testenv.AMQPURL() when empty).
func NewRabbit(t testing.TB, rawURL string, durable bool) *Rabbit {
	t.Helper()
	if rawURL == "" {
		rawURL = testenv.AMQPURL()
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatalf("AMQP URL: %v", err)
	}
	testenv.RequireTCP(t, "RabbitMQ", u.Host)
	r := &Rabbit{t: t, URL: rawURL, Exchange: testenv.Name("idemtest_x"), Queue: testenv.Name("idemtest_q")}
	r.Admin(func(ch *amqp091.Channel) error {
		if err := ch.ExchangeDeclare(r.Exchange, amqp091.ExchangeTopic, durable, false, false, false, nil); err != nil {
			return err
		}
		if _, err := ch.QueueDeclare(r.Queue, durable, false, false, false, nil); err != nil {
			return err
		}
		return ch.QueueBind(r.Queue, "#", r.Exchange, false, nil)
	})
	t.Cleanup(func() {
		r.Admin(func(ch *amqp091.Channel) error {
			_, _ = ch.QueueDelete(r.Queue, false, false, false)
			return ch.ExchangeDelete(r.Exchange, false, false)
		})
	})
	return r
}

// Admin runs f on a fresh connection to the broker.
func (r *Rabbit) Admin(f func(ch *amqp091.Channel) error) {
	r.t.Helper()
	conn, err := amqp091.Dial(r.URL)
	if err != nil {
		r.t.Fatalf("RabbitMQ: %v", err)
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		r.t.Fatal(err)
	}
	if err := f(ch); err != nil {
		r.t.Fatal(err)
	}
}

// Arrival is one delivery seen by a Collector.
type Arrival struct {
	ID, Key string
	Body    []byte
	Headers amqp091.Table
}

// Collector consumes the queue until stopped, reconnecting when the broker
// closes its connection. handle, when set, decides the ack (true) or the
// requeue (false) of each delivery; otherwise every delivery is acked.
type Collector struct {
	mu       sync.Mutex
	arrivals []Arrival
	ids      map[string]int

	cancel context.CancelFunc
	done   chan struct{}
}

// Collect starts a Collector on r's queue, stopped when the test ends.
func (r *Rabbit) Collect(t testing.TB, handle func(ctx context.Context, d amqp091.Delivery) bool) *Collector {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c := &Collector{ids: map[string]int{}, cancel: cancel, done: make(chan struct{})}
	ready := make(chan struct{})
	var once sync.Once
	go func() {
		defer close(c.done)
		for ctx.Err() == nil {
			c.consume(ctx, r.URL, r.Queue, handle, func() { once.Do(func() { close(ready) }) })
			select {
			case <-ctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	select {
	case <-ready:
	case <-time.After(30 * time.Second):
		t.Fatal("collector did not start consuming")
	}
	t.Cleanup(c.Stop)
	return c
}

func (c *Collector) consume(ctx context.Context, rawURL, queue string, handle func(context.Context, amqp091.Delivery) bool, ready func()) {
	conn, err := amqp091.Dial(rawURL)
	if err != nil {
		return
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	if err := ch.Qos(500, 0, false); err != nil {
		return
	}
	ds, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return
	}
	ready()
	for {
		select {
		case <-ctx.Done():
			return
		case d, ok := <-ds:
			if !ok {
				return
			}
			if handle != nil && !handle(ctx, d) {
				_ = d.Nack(false, true)
				continue
			}
			c.mu.Lock()
			c.arrivals = append(c.arrivals, Arrival{ID: d.MessageId, Key: d.RoutingKey, Body: d.Body, Headers: d.Headers})
			c.ids[d.MessageId]++
			c.mu.Unlock()
			_ = d.Ack(false)
		}
	}
}

// Stop ends the consumer and waits for it.
func (c *Collector) Stop() {
	c.cancel()
	<-c.done
}

// Distinct is the number of distinct message ids seen.
func (c *Collector) Distinct() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.ids)
}

// Count is the number of deliveries of the message id.
func (c *Collector) Count(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ids[id]
}

// Snapshot returns the deliveries seen so far, in order.
func (c *Collector) Snapshot() []Arrival {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]Arrival(nil), c.arrivals...)
}
