package idemamqp

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// consQueue declares a fresh durable work queue on the broker at rawURL and
// deletes it, with the retry queues of delays and the dead-letter exchange
// and queue a Consumer declares for it, when the test ends.
func consQueue(t testing.TB, rawURL string, delays []time.Duration) string {
	t.Helper()
	return consQueueArgs(t, rawURL, delays, nil)
}

// consQueueArgs is consQueue with the work queue's declare arguments, for
// example {"x-queue-type": "quorum"}.
func consQueueArgs(t testing.TB, rawURL string, delays []time.Duration, args amqp091.Table) string {
	t.Helper()
	consRequireBroker(t, rawURL)
	q := testenv.Name("idemtest_cq")
	consAdmin(t, rawURL, func(ch *amqp091.Channel) error {
		_, err := ch.QueueDeclare(q, true, false, false, false, args)
		return err
	})
	t.Cleanup(func() {
		consAdmin(t, rawURL, func(ch *amqp091.Channel) error {
			_, _ = ch.QueueDelete(q, false, false, false)
			_, _ = ch.QueueDelete(q+".dlq", false, false, false)
			for _, d := range delays {
				_, _ = ch.QueueDelete(consRetryQueue(q, d), false, false, false)
			}
			return ch.ExchangeDelete(q+".dlx", false, false)
		})
	})
	return q
}

func consRequireBroker(t testing.TB, rawURL string) {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatalf("AMQP URL: %v", err)
	}
	testenv.RequireTCP(t, "RabbitMQ", u.Host)
}

// consAdmin runs f on a fresh connection to rawURL.
func consAdmin(t testing.TB, rawURL string, f func(ch *amqp091.Channel) error) {
	t.Helper()
	conn, err := amqp091.Dial(rawURL)
	if err != nil {
		if testenv.Required() {
			t.Fatalf("RabbitMQ: %v", err)
		}
		t.Skipf("RabbitMQ: %v", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := f(ch); err != nil {
		t.Fatal(err)
	}
}

// consPublish publishes msgs persistent to queue through the default
// exchange, with confirms.
func consPublish(t testing.TB, rawURL, queue string, msgs ...amqp091.Publishing) {
	t.Helper()
	consAdmin(t, rawURL, func(ch *amqp091.Channel) error {
		if err := ch.Confirm(false); err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		dcs := make([]*amqp091.DeferredConfirmation, 0, 512)
		wait := func() error {
			for _, dc := range dcs {
				ok, err := dc.WaitContext(ctx)
				if err != nil {
					return err
				}
				if !ok {
					return fmt.Errorf("publish nacked")
				}
			}
			dcs = dcs[:0]
			return nil
		}
		for _, m := range msgs {
			m.DeliveryMode = amqp091.Persistent
			dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, m)
			if err != nil {
				return err
			}
			dcs = append(dcs, dc)
			if len(dcs) == cap(dcs) {
				if err := wait(); err != nil {
					return err
				}
			}
		}
		return wait()
	})
}

// consMsgs returns n messages with ids prefix-0 ... prefix-(n-1).
func consMsgs(prefix string, n int) []amqp091.Publishing {
	ms := make([]amqp091.Publishing, n)
	for i := range ms {
		id := fmt.Sprintf("%s-%d", prefix, i)
		ms[i] = amqp091.Publishing{MessageId: id, Body: []byte("body of " + id)}
	}
	return ms
}

// consDepth returns the number of ready messages in queue.
func consDepth(t testing.TB, rawURL, queue string) int {
	t.Helper()
	var n int
	consAdmin(t, rawURL, func(ch *amqp091.Channel) error {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		n = q.Messages
		return err
	})
	return n
}

// consGetAll reads (and acks) every message of queue.
func consGetAll(t testing.TB, rawURL, queue string) []amqp091.Delivery {
	t.Helper()
	var out []amqp091.Delivery
	consAdmin(t, rawURL, func(ch *amqp091.Channel) error {
		for {
			d, ok, err := ch.Get(queue, true)
			if err != nil || !ok {
				return err
			}
			out = append(out, d)
		}
	})
	return out
}

// consWorkersStopped installs c's workersStopped hook. The returned wait
// blocks until a graceful stop has stopped the workers; it fails the test
// if Run returned first (stopped closed) or a minute passed.
func consWorkersStopped(t testing.TB, c *Consumer) (wait func(stopped <-chan struct{})) {
	hook := make(chan struct{})
	c.workersStopped = func() { close(hook) }
	return func(stopped <-chan struct{}) {
		t.Helper()
		select {
		case <-hook:
		case <-stopped:
			t.Fatal("Run returned without a graceful stop of its workers")
		case <-time.After(time.Minute):
			t.Fatal("the graceful stop did not stop the workers within a minute")
		}
	}
}

// consStopThenRelease stops a consumer whose handlers are blocked on
// release: once the stop has stopped the workers (waitWorkers, from
// consWorkersStopped), it releases the handlers and waits for Run to
// return.
func consStopThenRelease(stop func(), waitWorkers func(stopped <-chan struct{}), release chan struct{}) {
	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	waitWorkers(stopped)
	close(release)
	<-stopped
}

// consStart runs c until the returned stop is called (or the test ends)
// and waits for it to consume; stop fails the test when Run returned an
// error.
func consStart(t testing.TB, c *Consumer) (stop func()) {
	t.Helper()
	run := testenv.StartRun(t, c.Run, c.Ready())
	var once sync.Once
	stop = func() {
		t.Helper()
		once.Do(func() {
			if err := run(); err != nil {
				t.Errorf("Run: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// consRabbitmqctl runs the broker's CLI (see testenv.Rabbitmqctl).
func consRabbitmqctl(t testing.TB) func(args ...string) { t.Helper(); return testenv.Rabbitmqctl(t) }

// consVhost creates a fresh virtual host for the test (see
// testenv.RabbitVhost) and returns its name and broker URL.
func consVhost(t testing.TB, ctl func(args ...string)) (name, rawURL string) {
	t.Helper()
	return testenv.RabbitVhost(t, ctl)
}

func consQuiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// consChannel is the channel of a delivery a Consumer handed to its chain,
// for tests that close it to simulate a crash.
func consChannel(d *amqp091.Delivery) *amqp091.Channel {
	return d.Acknowledger.(consGuard).ch.(*amqp091.Channel)
}
