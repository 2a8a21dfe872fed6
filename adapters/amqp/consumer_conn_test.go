package idemamqp

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// consDial opens a connection to rawURL closed when the test ends.
func consDial(t *testing.T, rawURL string) *amqp091.Connection {
	t.Helper()
	consRequireBroker(t, rawURL)
	conn, err := amqp091.Dial(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// A Consumer on the caller's connection consumes on it, reopens its
// channels on it when one closes, never closes it (the caller still uses it
// after Run returned), and returns ErrConnectionClosed once the caller
// closes it.
func TestConsumerConn(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	conn := consDial(t, url)
	var closed atomic.Bool
	var handled atomic.Int64
	h := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		if msg.ID == "close-channel" && closed.CompareAndSwap(false, true) {
			// A channel error: the connection stays open.
			d, _ := DeliveryFrom(ctx)
			return consChannel(d).Close()
		}
		handled.Add(1)
		return nil
	})
	if _, err := NewConsumerConn(nil, q, h, ConsumerOptions{}); err == nil {
		t.Error("NewConsumerConn accepted a nil connection")
	}
	if _, err := NewConsumerConn(conn, q, h, ConsumerOptions{Dial: func(context.Context) (*amqp091.Connection, error) { return nil, nil }}); err == nil {
		t.Error("NewConsumerConn accepted Dial")
	}
	var abandoned atomic.Int64 // reported as a retry whose error wraps amqp091.ErrClosed
	c, err := NewConsumerConn(conn, q, h, consOpts(ConsumerOptions{
		Telemetry: consumer.Telemetry{
			OnOutcome: func(_ context.Context, r consumer.Report) {
				if r.Result.Action == consumer.ActionRetry && errors.Is(r.Err, amqp091.ErrClosed) && r.Message.ID == "close-channel" {
					abandoned.Add(1)
				}
			},
		},
	}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	consPublish(t, url, q, amqp091.Publishing{MessageId: "close-channel", Body: []byte("x")})
	consPublish(t, url, q, consMsgs("conn", 5)...)
	testenv.Eventually(t, 30*time.Second, "6 messages handled", func() bool { return handled.Load() == 6 && c.Stats().Acked == 6 })
	stop()
	if st := c.Stats(); st.Connects != 2 || st.Abandoned != 1 {
		t.Errorf("stats %+v: want 2 sessions on the one connection and 1 abandoned delivery", st)
	}
	if n := abandoned.Load(); n != 1 {
		t.Errorf("OnOutcome reported %d abandoned deliveries, want 1", n)
	}
	if conn.IsClosed() {
		t.Fatal("the Consumer closed the caller's connection")
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("the caller's connection is unusable after Run: %v", err)
	}
	_ = ch.Close()

	// The caller closes its connection under a running Consumer.
	conn2 := consDial(t, url)
	c2, err := NewConsumerConn(conn2, q, h, consOpts(ConsumerOptions{}))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c2.Run(context.Background()) }()
	<-c2.Ready()
	_ = conn2.Close()
	select {
	case err := <-done:
		if !errors.Is(err, ErrConnectionClosed) {
			t.Errorf("Run returned %v, want ErrConnectionClosed", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return after its connection closed")
	}
}

// ConsumerOptions.Dial opens the connections (the URL is not needed), and
// the Consumer closes those when Run returns.
func TestConsumerDial(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	var (
		mu    sync.Mutex
		conns []*amqp091.Connection
	)
	dial := func(ctx context.Context) (*amqp091.Connection, error) {
		if ctx == nil {
			return nil, errors.New("no context")
		}
		conn, err := amqp091.Dial(url)
		if err == nil {
			mu.Lock()
			conns = append(conns, conn)
			mu.Unlock()
		}
		return conn, err
	}
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	if _, err := NewConsumer("", q, h, ConsumerOptions{}); err == nil {
		t.Error("NewConsumer accepted an empty URL without Dial")
	}
	c, err := NewConsumer("", q, h, consOpts(ConsumerOptions{Dial: dial}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	consPublish(t, url, q, consMsgs("dial", 3)...)
	testenv.Eventually(t, 30*time.Second, "3 acks", func() bool { return c.Stats().Acked == 3 })
	stop()
	mu.Lock()
	defer mu.Unlock()
	if len(conns) != 1 {
		t.Fatalf("Dial called %d times, want 1", len(conns))
	}
	if !conns[0].IsClosed() {
		t.Error("the dialled connection is still open after Run returned")
	}
}

// With NoDeclare, Run declares nothing: it fails at start, naming what is
// missing, and creates none of it; once the topology is declared as the
// option's documentation says, retries and dead letters go through it.
func TestConsumerNoDeclare(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	var tries atomic.Int64
	h := consumer.Chain(consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		if msg.ID == "bad" {
			return consumer.Permanent(errors.New("cannot parse the payload"))
		}
		if tries.Add(1) == 1 {
			return errors.New("downstream unavailable")
		}
		return nil
	}), consumer.Recover(), consMemDedup(t, "test/nodeclare"))
	opts := consOpts(ConsumerOptions{NoDeclare: true})
	c, err := NewConsumer(url, q, h, opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = c.Run(ctx)
	if !errors.Is(err, ErrTopologyMissing) || !strings.Contains(err.Error(), consRetryQueue(q, consTestDelays[0])) {
		t.Fatalf("Run returned %v; want ErrTopologyMissing naming %s", err, consRetryQueue(q, consTestDelays[0]))
	}
	t.Logf("Run: %v", err)
	conn := consDial(t, url)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.ExchangeDeclarePassive(q+".dlx", amqp091.ExchangeDirect, false, false, false, false, nil); err == nil {
		t.Error("Run declared the dead-letter exchange")
	}

	// The topology, declared elsewhere, with only what the option's
	// documentation asks for, and the dead-letter queue named otherwise.
	dlq := q + ".dlq"
	consAdmin(t, url, func(ch *amqp091.Channel) error {
		for _, d := range consTestDelays {
			if _, err := ch.QueueDeclare(consRetryQueue(q, d), true, false, false, false,
				amqp091.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": q}); err != nil {
				return err
			}
		}
		if _, err := ch.QueueDeclare(dlq, true, false, false, false, nil); err != nil {
			return err
		}
		if err := ch.ExchangeDeclare(q+".dlx", amqp091.ExchangeDirect, true, false, false, false, nil); err != nil {
			return err
		}
		return ch.QueueBind(dlq, q, q+".dlx", false, nil)
	})
	c, err = NewConsumer(url, q, h, opts)
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	consPublish(t, url, q, amqp091.Publishing{MessageId: "flaky", Body: []byte("f")}, amqp091.Publishing{MessageId: "bad", Body: []byte("b")})
	testenv.Eventually(t, 30*time.Second, "a retry, an ack and a dead letter", func() bool {
		st := c.Stats()
		return st.Retried == 1 && st.Acked == 1 && st.DeadLettered == 1
	})
	stop()
	if dead := consGetAll(t, url, dlq); len(dead) != 1 || dead[0].MessageId != "bad" {
		t.Errorf("dead-letter queue: %d messages, want bad", len(dead))
	}
}
