package sqloutbox_test

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/sqloutbox"
)

// rabbit is a test's exchange and queue on RabbitMQ (a topic exchange with
// the queue bound on "#"), deleted when the test ends.
type rabbit struct {
	t        testing.TB
	url      string
	exchange string
	queue    string
}

// newRabbit declares the test's exchange and queue on the broker at rawURL
// (testenv.AMQPURL() when empty).
func newRabbit(t testing.TB, rawURL string, durable bool) *rabbit {
	t.Helper()
	if rawURL == "" {
		rawURL = testenv.AMQPURL()
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatalf("AMQP URL: %v", err)
	}
	testenv.RequireTCP(t, "RabbitMQ", u.Host)
	r := &rabbit{t: t, url: rawURL, exchange: testenv.Name("idemtest_x"), queue: testenv.Name("idemtest_q")}
	r.admin(func(ch *amqp091.Channel) error {
		if err := ch.ExchangeDeclare(r.exchange, amqp091.ExchangeTopic, durable, false, false, false, nil); err != nil {
			return err
		}
		if _, err := ch.QueueDeclare(r.queue, durable, false, false, false, nil); err != nil {
			return err
		}
		return ch.QueueBind(r.queue, "#", r.exchange, false, nil)
	})
	t.Cleanup(func() {
		r.admin(func(ch *amqp091.Channel) error {
			_, _ = ch.QueueDelete(r.queue, false, false, false)
			return ch.ExchangeDelete(r.exchange, false, false)
		})
	})
	return r
}

// admin runs f on a fresh connection.
func (r *rabbit) admin(f func(ch *amqp091.Channel) error) {
	r.t.Helper()
	conn, err := amqp091.Dial(r.url)
	if err != nil {
		r.t.Fatalf("RabbitMQ: %v", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		r.t.Fatal(err)
	}
	if err := f(ch); err != nil {
		r.t.Fatal(err)
	}
}

// arrival is one delivery seen by a collector.
type arrival struct {
	id, key string
	body    []byte
	headers amqp091.Table
}

// collector consumes the queue until stopped, reconnecting when the broker
// closes its connection. handle, when set, decides the ack (true) or the
// requeue (false) of each delivery; otherwise every delivery is acked.
type collector struct {
	mu       sync.Mutex
	arrivals []arrival
	ids      map[string]int

	cancel context.CancelFunc
	done   chan struct{}
}

func (r *rabbit) collect(t testing.TB, handle func(ctx context.Context, d amqp091.Delivery) bool) *collector {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c := &collector{ids: map[string]int{}, cancel: cancel, done: make(chan struct{})}
	ready := make(chan struct{})
	var once sync.Once
	go func() {
		defer close(c.done)
		for ctx.Err() == nil {
			c.consume(ctx, r.url, r.queue, handle, func() { once.Do(func() { close(ready) }) })
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
	t.Cleanup(c.stop)
	return c
}

func (c *collector) consume(ctx context.Context, rawURL, queue string, handle func(context.Context, amqp091.Delivery) bool, ready func()) {
	conn, err := amqp091.Dial(rawURL)
	if err != nil {
		return
	}
	defer conn.Close()
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
			c.arrivals = append(c.arrivals, arrival{id: d.MessageId, key: d.RoutingKey, body: d.Body, headers: d.Headers})
			c.ids[d.MessageId]++
			c.mu.Unlock()
			_ = d.Ack(false)
		}
	}
}

func (c *collector) stop() {
	c.cancel()
	<-c.done
}

// distinct is the number of distinct message ids seen.
func (c *collector) distinct() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.ids)
}

func (c *collector) snapshot() []arrival {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]arrival(nil), c.arrivals...)
}

func newAMQPPublisher(t testing.TB, rawURL string) *idemamqp.Publisher {
	t.Helper()
	p, err := idemamqp.NewPublisher(rawURL, idemamqp.PublisherOptions{
		Logger: quiet(), ReconnectBackoff: consumer.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// Two MariaDB relays publish to RabbitMQ through adapters/amqp's publisher
// (publisher confirms): every message arrives with its outbox id as its
// AMQP message-id, each key's messages in order.
func TestMariaDBRelaysToRabbitMQ(t *testing.T) {
	db := mariaDB(t)
	ob := newOutbox(t, db, sqloutbox.MySQL, sqloutbox.Options{})
	rb := newRabbit(t, "", false)
	col := rb.collect(t, nil)
	for range 2 {
		r, err := sqloutbox.NewRelay(ob, newAMQPPublisher(t, rb.url), fastRelay(sqloutbox.RelayOptions{
			Sessions: 2, BatchSize: 50, CleanupInterval: -1,
		}))
		if err != nil {
			t.Fatal(err)
		}
		start(t, r)
	}
	const keys, perKey = 20, 25
	want := map[string]string{}
	for n := range perKey {
		var ms []outbox.Message
		for k := range keys {
			key := fmt.Sprintf("k%02d", k)
			ms = append(ms, msg(rb.exchange, key, fmt.Sprintf("%s/%d", key, n)))
		}
		for i, id := range enqueue(t, db, ob, ms...) {
			want[id] = string(ms[i].Payload)
		}
	}
	testenv.Eventually(t, 60*time.Second, "every message delivered", func() bool { return col.distinct() >= len(want) })
	var payloads []string
	for _, a := range col.snapshot() {
		p, ok := want[a.id]
		if !ok {
			t.Fatalf("delivery with message-id %q, not an outbox id", a.id)
		}
		if string(a.body) != p || !strings.HasPrefix(p, a.key+"/") {
			t.Fatalf("message %s arrived as %q with routing key %q, want %q", a.id, a.body, a.key, p)
		}
		payloads = append(payloads, p)
	}
	if bad := orderViolations(payloads); len(bad) > 0 {
		t.Fatalf("per-key order violated: %v", bad)
	}
	testenv.Eventually(t, 30*time.Second, "every row marked published", func() bool { return countState(t, db, ob, 1) == len(want) })
}
