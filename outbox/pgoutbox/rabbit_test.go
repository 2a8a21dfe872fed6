package pgoutbox_test

import (
	"context"
	"net"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/internal/testenv"
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

func (c *collector) count(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ids[id]
}

func (c *collector) snapshot() []arrival {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]arrival(nil), c.arrivals...)
}

// rabbitmqctl runs the broker's CLI, which works only on the broker's own
// machine. The test skips (fails under CI=true) when the broker is not local
// or the CLI is missing or cannot reach it.
func rabbitmqctl(t testing.TB) func(args ...string) {
	t.Helper()
	u, err := url.Parse(testenv.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	host := u.Hostname()
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		unavailable(t, "rabbitmqctl needs the broker on this machine; IDEM_TEST_AMQP_URL points at "+host)
	}
	bin, err := exec.LookPath("rabbitmqctl")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/rabbitmqctl"); serr == nil {
			bin = "/usr/sbin/rabbitmqctl"
		} else {
			unavailable(t, "rabbitmqctl is not installed")
		}
	}
	run := func(args ...string) ([]byte, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		return exec.CommandContext(ctx, bin, append([]string{"--quiet"}, args...)...).CombinedOutput()
	}
	if out, err := run("status"); err != nil {
		unavailable(t, "rabbitmqctl status failed: "+strings.TrimSpace(string(out))+": "+err.Error())
	}
	return func(args ...string) {
		t.Helper()
		if out, err := run(args...); err != nil {
			t.Fatalf("rabbitmqctl %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
}

func unavailable(t testing.TB, msg string) {
	t.Helper()
	if testenv.Required() {
		t.Fatal(msg + "; CI=true or IDEM_REQUIRE_SERVICES=1 makes this a failure")
	}
	t.Skip(msg)
}

// vhost creates a fresh virtual host for the test (deleted at the end), so
// close_all_connections hits only the test's connections, and returns the
// broker URL for it.
func vhost(t testing.TB, ctl func(args ...string)) string {
	t.Helper()
	u, err := url.Parse(testenv.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	name := testenv.Name("idemtest_vh")
	user := u.User.Username()
	if user == "" {
		user = "guest"
	}
	ctl("add_vhost", name)
	t.Cleanup(func() { ctl("delete_vhost", name) })
	ctl("set_permissions", "-p", name, user, ".*", ".*", ".*")
	u.Path = "/" + name
	u.RawPath = ""
	return u.String()
}
