package idemamqp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// pubBroker is a test's view of RabbitMQ: an admin connection, and the
// exchanges and queues the test declared (deleted at the end).
type pubBroker struct {
	t    *testing.T
	conn *amqp091.Connection
	ch   *amqp091.Channel
}

func pubNewBroker(t *testing.T) *pubBroker {
	t.Helper()
	u, err := url.Parse(testenv.AMQPURL())
	if err != nil {
		t.Fatalf("IDEM_TEST_AMQP_URL: %v", err)
	}
	testenv.RequireTCP(t, "RabbitMQ", u.Host)
	conn, err := amqp091.Dial(testenv.AMQPURL())
	if err != nil {
		if testenv.Required() {
			t.Fatalf("RabbitMQ at %s: %v", u.Host, err)
		}
		t.Skipf("RabbitMQ at %s: %v", u.Host, err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	b := &pubBroker{t: t, conn: conn, ch: ch}
	t.Cleanup(func() { _ = conn.Close() })
	return b
}

// exchange declares a topic exchange, deleted when the test ends.
func (b *pubBroker) exchange(prefix string) string {
	b.t.Helper()
	name := testenv.Name(prefix)
	if err := b.ch.ExchangeDeclare(name, amqp091.ExchangeTopic, false, false, false, false, nil); err != nil {
		b.t.Fatal(err)
	}
	b.t.Cleanup(func() { _ = b.ch.ExchangeDelete(name, false, false) })
	return name
}

// queue declares a queue bound to exchange with binding key, deleted when
// the test ends.
func (b *pubBroker) queue(exchange, binding string, args amqp091.Table) string {
	b.t.Helper()
	q, err := b.ch.QueueDeclare(testenv.Name("idemtest_q"), false, false, false, false, args)
	if err != nil {
		b.t.Fatal(err)
	}
	b.t.Cleanup(func() { _, _ = b.ch.QueueDelete(q.Name, false, false, false) })
	if err := b.ch.QueueBind(q.Name, binding, exchange, false, nil); err != nil {
		b.t.Fatal(err)
	}
	return q.Name
}

// get reads n messages from queue, and fails the test when they do not
// all arrive within 10s.
func (b *pubBroker) get(queue string, n int) []amqp091.Delivery {
	b.t.Helper()
	var out []amqp091.Delivery
	testenv.Eventually(b.t, 10*time.Second, fmt.Sprintf("%d messages in %s", n, queue), func() bool {
		for len(out) < n {
			d, ok, err := b.ch.Get(queue, true)
			if err != nil {
				b.t.Fatal(err)
			}
			if !ok {
				return false
			}
			out = append(out, d)
		}
		return true
	})
	return out
}

// pubLeakCheck fails the test if goroutines started during it are still
// running after its cleanups (which close the connections).
func pubLeakCheck(t *testing.T) {
	t.Helper()
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		if err := goleak.Find(ignore); err != nil {
			t.Error(err)
		}
	})
}

func pubQuiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

func pubNew(t *testing.T, rawURL string, opts PublisherOptions) *Publisher {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = pubQuiet()
	}
	p, err := NewPublisher(rawURL, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func pubMsg(topic, key, body string) *outbox.Message {
	return &outbox.Message{
		ID:        testenv.Name("msg"),
		Topic:     topic,
		Key:       []byte(key),
		Payload:   []byte(body),
		Headers:   map[string]string{"x-test": body, outbox.HeaderTraceParent: "00-aa-bb-01"},
		CreatedAt: time.Unix(1700000000, 0),
		Attempt:   1,
	}
}

func pubFailed(t *testing.T, err error) map[int]error {
	t.Helper()
	if err == nil {
		return nil
	}
	var pe *outbox.PublishError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish error %v is not an *outbox.PublishError", err)
	}
	return pe.Failed
}

func TestPublisherOptions(t *testing.T) {
	t.Parallel()
	if _, err := NewPublisher("http://x", PublisherOptions{}); err == nil {
		t.Error("NewPublisher(http URL) = nil error")
	}
	if _, err := NewPublisher("amqp://x", PublisherOptions{ConfirmTimeout: -1}); err == nil {
		t.Error("negative ConfirmTimeout accepted")
	}
	if _, err := NewPublisher("amqp://x", PublisherOptions{ReconnectBackoff: consumer.Backoff{Initial: time.Minute, Max: time.Second}}); err == nil {
		t.Error("ReconnectBackoff with Initial above Max accepted")
	}
}

// Every message goes to its exchange with its key as routing key,
// persistent, with the outbox id as message-id and the headers.
func TestPublisherConfirmsAndProperties(t *testing.T) {
	pubLeakCheck(t)
	b := pubNewBroker(t)
	x := b.exchange("idemtest_x")
	q := b.queue(x, "orders.#", nil)
	p := pubNew(t, testenv.AMQPURL(), PublisherOptions{ContentType: "application/json"})
	ctx := context.Background()

	msgs := []*outbox.Message{pubMsg(x, "orders.1", "a"), pubMsg(x, "orders.2", "b"), pubMsg(x, "orders.1", "c")}
	if err := p.Publish(ctx, msgs); err != nil {
		t.Fatal(err)
	}
	got := b.get(q, 3)
	if len(got) != 3 {
		t.Fatalf("got %d messages, want 3", len(got))
	}
	for i, d := range got {
		m := msgs[i]
		if d.MessageId != m.ID || string(d.Body) != string(m.Payload) || d.RoutingKey != string(m.Key) || d.Exchange != x {
			t.Errorf("delivery %d: id %s body %s key %s exchange %s; want %+v", i, d.MessageId, d.Body, d.RoutingKey, d.Exchange, m)
		}
		if d.DeliveryMode != amqp091.Persistent || d.ContentType != "application/json" || !d.Timestamp.Equal(m.CreatedAt) {
			t.Errorf("delivery %d: mode %d type %q time %v", i, d.DeliveryMode, d.ContentType, d.Timestamp)
		}
		if d.Headers["x-test"] != string(m.Payload) || d.Headers[outbox.HeaderTraceParent] != "00-aa-bb-01" {
			t.Errorf("delivery %d: headers %v", i, d.Headers)
		}
	}
	// Publishing again reuses the connection and channel.
	if err := p.Publish(ctx, []*outbox.Message{pubMsg(x, "orders.3", "d")}); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Publish(ctx, []*outbox.Message{pubMsg(x, "orders.3", "e")}); !errors.Is(err, ErrPublisherClosed) {
		t.Fatalf("Publish after Close = %v, want ErrPublisherClosed", err)
	}
}

// A returned (unroutable) message, a message to a missing exchange and an
// invalid message fail alone; the rest of the batch is confirmed.
func TestPublisherPerMessageFailures(t *testing.T) {
	pubLeakCheck(t)
	b := pubNewBroker(t)
	x := b.exchange("idemtest_x")
	q := b.queue(x, "ok", nil)
	p := pubNew(t, testenv.AMQPURL(), PublisherOptions{})
	missing := testenv.Name("idemtest_missing")

	msgs := []*outbox.Message{
		pubMsg(x, "ok", "1"),
		pubMsg(x, "nobody-listens", "2"),
		pubMsg(missing, "ok", "3"),
		pubMsg(x, strings.Repeat("k", 300), "4"),
		pubMsg(x, "ok", "5"),
	}
	failed := pubFailed(t, p.Publish(context.Background(), msgs))
	if len(failed) != 3 || !errors.Is(failed[1], ErrReturned) || !errors.Is(failed[2], ErrNoExchange) || !errors.Is(failed[3], ErrInvalidMessage) {
		t.Fatalf("failed = %v; want #1 returned, #2 no exchange, #3 invalid", failed)
	}
	got := b.get(q, 2)
	if len(got) != 2 || string(got[0].Body) != "1" || string(got[1].Body) != "5" {
		t.Fatalf("delivered %d messages, want 1 and 5", len(got))
	}

	// With AllowUnroutable the unroutable message is confirmed (and dropped
	// by the broker).
	p2 := pubNew(t, testenv.AMQPURL(), PublisherOptions{AllowUnroutable: true})
	if err := p2.Publish(context.Background(), []*outbox.Message{pubMsg(x, "nobody-listens", "6")}); err != nil {
		t.Fatal(err)
	}
}

// A queue that rejects publishes when full makes the broker nack: the
// nacked messages fail as unconfirmed.
func TestPublisherNack(t *testing.T) {
	pubLeakCheck(t)
	b := pubNewBroker(t)
	x := b.exchange("idemtest_x")
	q := b.queue(x, "#", amqp091.Table{"x-max-length": int32(2), "x-overflow": "reject-publish"})
	p := pubNew(t, testenv.AMQPURL(), PublisherOptions{})
	var msgs []*outbox.Message
	for i := range 5 {
		msgs = append(msgs, pubMsg(x, "k", fmt.Sprint(i)))
	}
	failed := pubFailed(t, p.Publish(context.Background(), msgs))
	if len(failed) != 3 {
		t.Fatalf("failed = %v; want the last 3 nacked", failed)
	}
	for i := 2; i < 5; i++ {
		if !errors.Is(failed[i], ErrUnconfirmed) {
			t.Errorf("failed[%d] = %v, want ErrUnconfirmed", i, failed[i])
		}
	}
	if got := b.get(q, 2); len(got) != 2 {
		t.Fatalf("queue holds %d messages, want 2", len(got))
	}
}

// An exchange deleted after it was checked makes the broker close the
// channel mid-batch; the publisher finds the message that causes it by
// resending one by one, and the others are confirmed.
func TestPublisherChannelExceptionIsolatesTheMessage(t *testing.T) {
	pubLeakCheck(t)
	b := pubNewBroker(t)
	keep := b.exchange("idemtest_keep")
	q := b.queue(keep, "#", nil)
	gone := b.exchange("idemtest_gone")
	b.queue(gone, "#", nil)
	p := pubNew(t, testenv.AMQPURL(), PublisherOptions{})
	ctx := context.Background()
	if err := p.Publish(ctx, []*outbox.Message{pubMsg(keep, "k", "0"), pubMsg(gone, "k", "0")}); err != nil {
		t.Fatal(err)
	}
	b.get(q, 1)
	if err := b.ch.ExchangeDelete(gone, false, false); err != nil {
		t.Fatal(err)
	}
	msgs := []*outbox.Message{pubMsg(keep, "k", "1"), pubMsg(gone, "k", "2"), pubMsg(keep, "k", "3")}
	failed := pubFailed(t, p.Publish(ctx, msgs))
	if len(failed) != 1 || failed[1] == nil {
		t.Fatalf("failed = %v; want only #1", failed)
	}
	// 1 may arrive twice: the broker may close the channel before its
	// confirm went out, and then it is sent again.
	bodies := map[string]int{}
	deadline := time.Now().Add(10 * time.Second)
	for (bodies["1"] == 0 || bodies["3"] == 0) && time.Now().Before(deadline) {
		for _, d := range b.get(q, 1) {
			bodies[string(d.Body)]++
		}
	}
	if bodies["1"] == 0 || bodies["3"] == 0 || bodies["2"] != 0 {
		t.Fatalf("delivered %v, want 1 and 3", bodies)
	}
	// The publisher goes on.
	if err := p.Publish(ctx, []*outbox.Message{pubMsg(keep, "k", "4")}); err != nil {
		t.Fatal(err)
	}
}

// pubProxy forwards TCP connections to the broker; it can stall the
// broker-to-client direction (confirms stop arriving) and cut every
// connection.
type pubProxy struct {
	ln     net.Listener
	target string

	mu     sync.Mutex
	conns  []net.Conn
	stall  bool
	resume chan struct{}
	wg     sync.WaitGroup
	up     atomic.Int64 // bytes forwarded from clients to the broker
}

func pubNewProxy(t *testing.T, target string) *pubProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	px := &pubProxy{ln: ln, target: target, resume: make(chan struct{})}
	px.wg.Go(px.accept)
	t.Cleanup(px.close)
	return px
}

func (px *pubProxy) accept() {
	for {
		c, err := px.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", px.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		px.mu.Lock()
		px.conns = append(px.conns, c, s)
		px.mu.Unlock()
		px.wg.Go(func() { px.pipe(c, s, false) })
		px.wg.Go(func() { px.pipe(s, c, true) })
	}
}

// pipe copies from src to dst; downstream (broker to client) copies wait
// while the proxy is stalled.
func (px *pubProxy) pipe(src, dst net.Conn, downstream bool) {
	defer func() { _ = src.Close(); _ = dst.Close() }()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && downstream {
			px.mu.Lock()
			stalled, resume := px.stall, px.resume
			px.mu.Unlock()
			if stalled {
				<-resume
			}
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
			if !downstream {
				px.up.Add(int64(n))
			}
		}
		if err != nil {
			return
		}
	}
}

func (px *pubProxy) setStall(on bool) {
	px.mu.Lock()
	defer px.mu.Unlock()
	if on == px.stall {
		return
	}
	px.stall = on
	if !on {
		close(px.resume)
		px.resume = make(chan struct{})
	}
}

// cut closes every proxied connection.
func (px *pubProxy) cut() {
	px.mu.Lock()
	conns := px.conns
	px.conns = nil
	px.mu.Unlock()
	for _, c := range conns {
		_ = c.Close()
	}
}

func (px *pubProxy) close() {
	_ = px.ln.Close()
	px.setStall(false)
	px.cut()
	px.wg.Wait()
}

func (px *pubProxy) url(t *testing.T) string {
	u, err := url.Parse(testenv.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	u.Host = px.ln.Addr().String()
	return u.String()
}

func pubTarget(t *testing.T) string {
	u, err := url.Parse(testenv.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	return u.Host
}

// Confirms that do not arrive within ConfirmTimeout fail the messages as
// unconfirmed; the next Publish reconnects and works.
func TestPublisherConfirmTimeout(t *testing.T) {
	pubLeakCheck(t)
	b := pubNewBroker(t)
	x := b.exchange("idemtest_x")
	q := b.queue(x, "#", nil)
	px := pubNewProxy(t, pubTarget(t))
	p := pubNew(t, px.url(t), PublisherOptions{ConfirmTimeout: 300 * time.Millisecond, ReconnectBackoff: consumer.Backoff{Initial: 10 * time.Millisecond}})
	ctx := context.Background()
	if err := p.Publish(ctx, []*outbox.Message{pubMsg(x, "k", "warm")}); err != nil {
		t.Fatal(err)
	}
	px.setStall(true)
	msgs := []*outbox.Message{pubMsg(x, "k", "1"), pubMsg(x, "k", "2")}
	failed := pubFailed(t, p.Publish(ctx, msgs))
	if len(failed) != 2 || !errors.Is(failed[0], ErrUnconfirmed) || !errors.Is(failed[1], ErrUnconfirmed) {
		t.Fatalf("failed = %v; want both unconfirmed", failed)
	}
	px.setStall(false)
	px.cut()
	var err error
	// The first attempts may still see the old connection die.
	testenv.Eventually(t, 10*time.Second, "a Publish after the stall to succeed", func() bool {
		err = p.Publish(ctx, []*outbox.Message{pubMsg(x, "k", "3")})
		return err == nil
	})
	// The stalled messages may or may not have reached the queue: that is
	// what "unknown" means. The last one did.
	testenv.Eventually(t, 10*time.Second, "message 3 to be delivered", func() bool {
		for {
			d, ok, err := b.ch.Get(q, true)
			if err != nil {
				t.Fatal(err)
			}
			if !ok {
				return false
			}
			if string(d.Body) == "3" {
				return true
			}
		}
	})
}

// A connection lost before or during a batch: Publish returns a plain error
// (the whole batch unknown) and a later Publish reconnects.
func TestPublisherReconnects(t *testing.T) {
	pubLeakCheck(t)
	b := pubNewBroker(t)
	x := b.exchange("idemtest_x")
	q := b.queue(x, "#", nil)
	px := pubNewProxy(t, pubTarget(t))
	p := pubNew(t, px.url(t), PublisherOptions{ReconnectBackoff: consumer.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	ctx := context.Background()
	if err := p.Publish(ctx, []*outbox.Message{pubMsg(x, "k", "0")}); err != nil {
		t.Fatal(err)
	}
	px.cut()
	delivered := 1
	var sawPlainError bool
	for i := 1; i <= 20; i++ {
		var batch []*outbox.Message
		for j := range 200 {
			batch = append(batch, pubMsg(x, "k", fmt.Sprint(i, "-", j)))
		}
		var err error
		if i == 5 {
			// Cut while the batch is in flight: confirms are held back, the
			// batch has reached the broker (bytes went up), then the cut.
			px.setStall(true)
			sent := px.up.Load()
			errc := make(chan error, 1)
			go func() { errc <- p.Publish(ctx, batch) }()
			testenv.Eventually(t, 30*time.Second, "batch 5 to send something", func() bool { return px.up.Load() != sent })
			px.cut()
			px.setStall(false)
			err = <-errc
			if err == nil {
				t.Fatal("batch 5: Publish succeeded although the connection was cut before any confirm")
			}
		} else {
			// After the cut before batch 1, Publish either finds the
			// connection lost (a plain error) or, having noticed the close
			// already, reconnects first and succeeds.
			err = p.Publish(ctx, batch)
		}
		var pe *outbox.PublishError
		switch {
		case err == nil:
			delivered += len(batch)
		case errors.As(err, &pe):
			t.Fatalf("batch %d: per-message failures %v after a lost connection; want a plain error", i, pe)
		default:
			sawPlainError = true
		}
	}
	if !sawPlainError {
		t.Error("no Publish saw the lost connection")
	}
	if delivered < 200 {
		t.Fatalf("only %d messages confirmed after reconnecting", delivered)
	}
	// Counted by the broker (one Get per message for thousands of them
	// would race get's deadline on a loaded machine).
	testenv.Eventually(t, 30*time.Second, fmt.Sprintf("the queue to hold the %d confirmed messages", delivered), func() bool {
		st, err := b.ch.QueueDeclarePassive(q, false, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		return st.Messages >= delivered
	})
}

// The broker unreachable: Publish fails with a plain error, quickly after
// the first time (backoff), and works once the broker is back.
func TestPublisherBrokerDown(t *testing.T) {
	pubLeakCheck(t)
	u, err := url.Parse(testenv.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	u.Host = testenv.DeadAddr(t)
	p := pubNew(t, u.String(), PublisherOptions{ReconnectBackoff: consumer.Backoff{Initial: 5 * time.Millisecond}})
	for range 3 {
		err := p.Publish(context.Background(), []*outbox.Message{pubMsg("x", "k", "1")})
		var pe *outbox.PublishError
		if err == nil || errors.As(err, &pe) {
			t.Fatalf("Publish with the broker down = %v; want a plain error", err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := p.Publish(ctx, []*outbox.Message{pubMsg("x", "k", "1")}); !errors.Is(err, context.Canceled) {
		t.Fatalf("Publish with a cancelled context = %v", err)
	}
}

var _ io.Closer = (*Publisher)(nil)

// Concurrent Publish calls use separate channels of one connection.
func TestPublisherConcurrent(t *testing.T) {
	pubLeakCheck(t)
	b := pubNewBroker(t)
	x := b.exchange("idemtest_x")
	q := b.queue(x, "#", nil)
	p := pubNew(t, testenv.AMQPURL(), PublisherOptions{})
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for g := range 4 {
		wg.Go(func() {
			for i := range 10 {
				var batch []*outbox.Message
				for j := range 20 {
					batch = append(batch, pubMsg(x, fmt.Sprint("k", g), fmt.Sprint(g, "-", i, "-", j)))
				}
				if err := p.Publish(context.Background(), batch); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if got := b.get(q, 800); len(got) != 800 {
		t.Fatalf("queue holds %d messages, want 800", len(got))
	}
}
