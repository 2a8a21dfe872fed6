package idemamqp

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/testkit/effectstest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// consTestBackoff makes short retry delays, distinct so that x-death
// shows which retry queue each retry went through: consTestDelays, 20ms,
// 40ms and 80ms.
var (
	consTestBackoff = consumer.Backoff{Initial: 20 * time.Millisecond, Max: 80 * time.Millisecond, Factor: 2}
	consTestDelays  = (&ConsumerOptions{Backoff: consTestBackoff}).retryDelays()
)

func consOpts(o ConsumerOptions) ConsumerOptions {
	o.Logger = consQuiet()
	if o.Backoff == (consumer.Backoff{}) {
		o.Backoff = consTestBackoff
	}
	if o.ReconnectBackoff == (consumer.Backoff{}) {
		o.ReconnectBackoff = consumer.Backoff{Initial: 20 * time.Millisecond}
	}
	return o
}

func consMemDedup(t testing.TB, scope string) consumer.Middleware {
	t.Helper()
	store, err := memstore.New(memstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = store.Close() })
	mw, err := consumer.Dedup(store, consumer.DedupOptions{Scope: scope})
	if err != nil {
		t.Fatal(err)
	}
	return mw
}

func TestNewConsumerValidates(t *testing.T) {
	t.Parallel()
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	for name, f := range map[string]func() error{
		"bad url":     func() error { _, err := NewConsumer("http://x", "q", h, ConsumerOptions{}); return err },
		"no queue":    func() error { _, err := NewConsumer(testenv.AMQPURL(), "", h, ConsumerOptions{}); return err },
		"nil handler": func() error { _, err := NewConsumer(testenv.AMQPURL(), "q", nil, ConsumerOptions{}); return err },
		"negative": func() error {
			_, err := NewConsumer(testenv.AMQPURL(), "q", h, ConsumerOptions{Prefetch: -1})
			return err
		},
		"tiny delay": func() error {
			_, err := NewConsumer(testenv.AMQPURL(), "q", h, ConsumerOptions{Backoff: consumer.Backoff{Initial: time.Microsecond}})
			return err
		},
		"long delay": func() error {
			_, err := NewConsumer(testenv.AMQPURL(), "q", h, ConsumerOptions{Backoff: consumer.Backoff{Max: 25 * time.Hour}})
			return err
		},
		"too many retry queues": func() error {
			_, err := NewConsumer(testenv.AMQPURL(), "q", h, ConsumerOptions{Backoff: consumer.Backoff{Initial: time.Millisecond, Max: time.Hour, Factor: 1.1}})
			return err
		},
		"factor below 1": func() error {
			_, err := NewConsumer(testenv.AMQPURL(), "q", h, ConsumerOptions{Backoff: consumer.Backoff{Factor: 0.5}})
			return err
		},
		"in flight below concurrency": func() error {
			_, err := NewConsumer(testenv.AMQPURL(), "q", h, ConsumerOptions{Concurrency: 4, InFlight: 2})
			return err
		},
		"in flight above prefetch": func() error {
			_, err := NewConsumer(testenv.AMQPURL(), "q", h, ConsumerOptions{Concurrency: 4, Prefetch: 10, InFlight: 11})
			return err
		},
		"negative in flight": func() error {
			_, err := NewConsumer(testenv.AMQPURL(), "q", h, ConsumerOptions{InFlight: -1})
			return err
		},
		"backoff order": func() error {
			_, err := NewConsumer(testenv.AMQPURL(), "q", h, ConsumerOptions{ReconnectBackoff: consumer.Backoff{Initial: time.Minute, Max: time.Second}})
			return err
		},
	} {
		if f() == nil {
			t.Errorf("%s: NewConsumer accepted it", name)
		}
	}
}

func TestConsumerRetryDelay(t *testing.T) {
	t.Parallel()
	c, err := NewConsumer(testenv.AMQPURL(), "q", consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }),
		ConsumerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := c.delays, []time.Duration{time.Second, 5 * time.Second, 25 * time.Second, 2 * time.Minute}; !slices.Equal(got, want) {
		t.Fatalf("default retry delays %v, want %v", got, want)
	}
	for _, tc := range []struct {
		attempt int
		hint    time.Duration
		want    time.Duration
	}{
		{1, 0, time.Second}, {2, 0, 5 * time.Second}, {3, 0, 25 * time.Second}, {4, 0, 2 * time.Minute}, {9, 0, 2 * time.Minute},
		{1, 2 * time.Second, 5 * time.Second}, {1, time.Minute, 2 * time.Minute}, {1, time.Hour, 2 * time.Minute}, {2, time.Second, 5 * time.Second},
	} {
		if got := c.retryDelay(tc.attempt, tc.hint); got != tc.want {
			t.Errorf("retryDelay(%d, %v) = %v, want %v", tc.attempt, tc.hint, got, tc.want)
		}
	}
}

// A channel closed while the handler runs: the handler's transaction
// commits, its delivery tag is dead (not acked, not on the new channel), the
// broker redelivers on the new connection, and the redelivery is
// acknowledged as a duplicate. The effect is applied once.
func TestConsumerChannelClosedMidHandler(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	o := effectstest.New(t, 4)
	var closed atomic.Bool
	h := o.Handler(t, func(ctx context.Context, _ *consumer.Message) error {
		if closed.CompareAndSwap(false, true) {
			d, ok := DeliveryFrom(ctx)
			if !ok {
				return errors.New("no delivery in the context")
			}
			// The channel the delivery came on: close it under the handler.
			return consChannel(d).Close()
		}
		return nil
	})
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{Concurrency: 2}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	consPublish(t, url, q, consMsgs("closed", 1)...)
	testenv.Eventually(t, 30*time.Second, "the redelivery to be acked as a duplicate", func() bool { return c.Stats().Duplicates >= 1 })
	stop()
	rows, distinct := o.Counts(t)
	st := c.Stats()
	t.Logf("stats: %+v", st)
	if rows != 1 || distinct != 1 {
		t.Fatalf("effects: %d rows for %d ids, want 1 for 1", rows, distinct)
	}
	if st.Abandoned < 1 || st.Redelivered < 1 || st.Connects < 2 {
		t.Errorf("want the first delivery abandoned, a redelivery and a reconnect; stats %+v", st)
	}
	if n := consDepth(t, url, q); n != 0 {
		t.Errorf("%d messages left in the queue", n)
	}
}

// A channel error from the broker while a NoDeclare Consumer consumes (an
// acknowledgement of an unknown delivery tag: PRECONDITION_FAILED, the
// code of a refused topology too) makes it reconnect, not return: the
// delivery of the closed channel is redelivered and acknowledged as a
// duplicate, and the effect is applied once.
func TestConsumerChannelErrorWhileConsumingReconnects(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	topoDeclare(t, url, q, func(int, time.Duration) (bool, amqp091.Table) {
		return true, amqp091.Table{argDeadLetterExchange: "", argDeadLetterRoutingKey: q}
	}, true)
	o := effectstest.New(t, 4)
	var refused atomic.Bool
	h := o.Handler(t, func(ctx context.Context, _ *consumer.Message) error {
		if refused.CompareAndSwap(false, true) {
			d, ok := DeliveryFrom(ctx)
			if !ok {
				return errors.New("no delivery in the context")
			}
			// The broker closes the channel with PRECONDITION_FAILED.
			return consChannel(d).Ack(d.DeliveryTag+1000, false)
		}
		return nil
	})
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{NoDeclare: true, Concurrency: 2}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	consPublish(t, url, q, consMsgs("refused", 1)...)
	testenv.Eventually(t, 30*time.Second, "the redelivery to be acked as a duplicate", func() bool { return c.Stats().Duplicates >= 1 })
	stop() // fails the test if Run returned an error
	rows, distinct := o.Counts(t)
	st := c.Stats()
	t.Logf("stats: %+v", st)
	if rows != 1 || distinct != 1 {
		t.Fatalf("effects: %d rows for %d ids, want 1 for 1", rows, distinct)
	}
	if st.Connects < 2 || st.Redelivered < 1 {
		t.Errorf("want a redelivery on a second connection; stats %+v", st)
	}
	if n := consDepth(t, url, q); n != 0 {
		t.Errorf("%d messages left in the queue", n)
	}
}

// The same message published twice with one message-id is applied once.
func TestConsumerSameMessageIDTwice(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	o := effectstest.New(t, 4)
	c, err := NewConsumer(url, q, o.Handler(t, nil), consOpts(ConsumerOptions{}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	m := consMsgs("twice", 2)
	consPublish(t, url, q, m[0], m[1], m[0])
	testenv.Eventually(t, 30*time.Second, "3 acks", func() bool { return c.Stats().Acked >= 3 })
	stop()
	rows, distinct := o.Counts(t)
	if rows != 2 || distinct != 2 {
		t.Fatalf("effects: %d rows for %d ids, want 2 for 2", rows, distinct)
	}
	if st := c.Stats(); st.Duplicates != 1 {
		t.Errorf("Duplicates = %d, want 1 (stats %+v)", st.Duplicates, st)
	}
}

// consXDeath returns, from a delivery's x-death header, the count per queue
// of the entries with reason "expired".
func consXDeath(d amqp091.Delivery) map[string]int64 {
	out := map[string]int64{}
	deaths, _ := d.Headers["x-death"].([]any)
	for _, e := range deaths {
		tb, ok := e.(amqp091.Table)
		if !ok {
			continue
		}
		q, _ := tb["queue"].(string)
		reason, _ := tb["reason"].(string)
		n, _ := consHeaderInt(tb["count"])
		if reason == "expired" {
			out[q] += n
		}
	}
	return out
}

// Retries go through the retry queues: a message failing transiently three
// times is handled on the 4th attempt, having waited in the retry queue of
// each configured delay once (the broker's x-death says so; no clock is
// read); one that always fails is dead-lettered after MaxAttempts with
// reason retries_exhausted; a Permanent error is dead-lettered at once.
func TestConsumerRetryBoundAndDelay(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	var (
		mu       sync.Mutex
		attempts = map[string][]int{}
		final    amqp091.Delivery
	)
	inner := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		attempts[msg.ID] = append(attempts[msg.ID], msg.Attempt)
		switch msg.ID {
		case "flaky":
			if msg.Attempt < 4 {
				return errors.New("downstream unavailable")
			}
			d, _ := DeliveryFrom(ctx)
			final = *d
			return nil
		case "always":
			return errors.New("downstream unavailable")
		case "poison":
			return consumer.Permanent(errors.New("cannot parse the payload"))
		}
		return nil
	})
	h := consumer.Chain(inner, consumer.Recover(), consMemDedup(t, "test/retry"))
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{MaxAttempts: 5, Concurrency: 3}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	consPublish(t, url, q,
		amqp091.Publishing{MessageId: "flaky", Body: []byte("f")},
		amqp091.Publishing{MessageId: "always", Body: []byte("a"), Headers: amqp091.Table{"tenant": "t1"}},
		amqp091.Publishing{MessageId: "poison", Body: []byte("p")})
	testenv.Eventually(t, 30*time.Second, "2 dead letters and the flaky message done", func() bool {
		st := c.Stats()
		return st.DeadLettered >= 2 && st.Acked >= 1
	})
	stop()
	mu.Lock()
	defer mu.Unlock()
	if got := attempts["flaky"]; !equalInts(got, []int{1, 2, 3, 4}) {
		t.Errorf("flaky attempts %v, want [1 2 3 4]", got)
	}
	if got := attempts["always"]; !equalInts(got, []int{1, 2, 3, 4, 5}) {
		t.Errorf("always attempts %v, want [1 2 3 4 5]", got)
	}
	if got := attempts["poison"]; !equalInts(got, []int{1}) {
		t.Errorf("poison attempts %v, want [1]", got)
	}
	deaths := consXDeath(final)
	for _, d := range consTestDelays {
		if n := deaths[consRetryQueue(q, d)]; n != 1 {
			t.Errorf("flaky went through %s %d times, want 1 (x-death %v)", consRetryQueue(q, d), n, final.Headers["x-death"])
		}
	}
	if n, _ := consHeaderInt(final.Headers[HeaderAttempt]); n != 4 {
		t.Errorf("flaky's %s = %d, want 4", HeaderAttempt, n)
	}
	dead := map[string]amqp091.Delivery{}
	for _, d := range consGetAll(t, url, q+".dlq") {
		dead[d.MessageId] = d
	}
	if len(dead) != 2 {
		t.Fatalf("dead-letter queue holds %d messages, want 2", len(dead))
	}
	for id, want := range map[string]struct {
		reason  string
		attempt int64
	}{"always": {"retries_exhausted", 5}, "poison": {"permanent", 1}} {
		d, ok := dead[id]
		if !ok {
			t.Errorf("%s is not in the dead-letter queue", id)
			continue
		}
		if r, _ := d.Headers[consumer.HeaderReason].(string); r != want.reason {
			t.Errorf("%s: %s = %q, want %q", id, consumer.HeaderReason, r, want.reason)
		}
		if n, _ := consHeaderInt(d.Headers[HeaderAttempt]); n != want.attempt {
			t.Errorf("%s: %s = %d, want %d", id, HeaderAttempt, n, want.attempt)
		}
		if e, _ := d.Headers[consumer.HeaderError].(string); !strings.Contains(e, "downstream unavailable") && !strings.Contains(e, "cannot parse") {
			t.Errorf("%s: %s = %q", id, consumer.HeaderError, e)
		}
		if n, _ := consHeaderInt(d.Headers[consumer.HeaderAttempts]); n != want.attempt {
			t.Errorf("%s: %s = %d, want %d", id, consumer.HeaderAttempts, n, want.attempt)
		}
		if d.Headers[consumer.HeaderID] != d.MessageId || d.MessageId == "" {
			t.Errorf("%s: %s = %v, message id %q", id, consumer.HeaderID, d.Headers[consumer.HeaderID], d.MessageId)
		}
		if d.DeliveryMode != amqp091.Persistent || d.Headers[consumer.HeaderSource] != q {
			t.Errorf("%s: delivery mode %d, %s %v", id, d.DeliveryMode, consumer.HeaderSource, d.Headers[consumer.HeaderSource])
		}
	}
	if tenant := dead["always"].Headers["tenant"]; tenant != "t1" {
		t.Errorf("the dead letter lost the message's headers: tenant = %v", tenant)
	}
	if n := consDepth(t, url, q); n != 0 {
		t.Errorf("%d messages left in the queue", n)
	}
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// A message without message-id (and no id header) is dead-lettered with
// reason invalid_key; the worker goes on with the next ones. With IDHeader
// set, the id comes from that header.
func TestConsumerNoMessageID(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	var (
		mu   sync.Mutex
		seen []string
	)
	inner := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		mu.Lock()
		seen = append(seen, msg.ID)
		mu.Unlock()
		return nil
	})
	h := consumer.Chain(inner, consumer.Recover(), consMemDedup(t, "test/noid"))
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{IDHeader: "x-request-id"}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	consPublish(t, url, q,
		amqp091.Publishing{Body: []byte("who am I")},
		amqp091.Publishing{MessageId: "ok-1", Body: []byte("1")},
		amqp091.Publishing{Headers: amqp091.Table{"x-request-id": "from-header"}, Body: []byte("2")})
	testenv.Eventually(t, 30*time.Second, "1 dead letter and 2 acks", func() bool {
		st := c.Stats()
		return st.DeadLettered >= 1 && st.Acked >= 2
	})
	stop()
	mu.Lock()
	defer mu.Unlock()
	if !equalStrings(seen, []string{"ok-1", "from-header"}) {
		t.Errorf("handled %q, want [ok-1 from-header]", seen)
	}
	dead := consGetAll(t, url, q+".dlq")
	if len(dead) != 1 || string(dead[0].Body) != "who am I" {
		t.Fatalf("dead-letter queue: %d messages", len(dead))
	}
	if r := dead[0].Headers[consumer.HeaderReason]; r != "invalid_key" {
		t.Errorf("%s = %v, want invalid_key", consumer.HeaderReason, r)
	}
}

// An IDHeader whose value is not a string is not an id: the message is
// dead-lettered with reason invalid_key and an error naming the header,
// without falling back to the message-id property and without running the
// handler.
func TestConsumerIDHeaderNotString(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	var ran atomic.Int64
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		ran.Add(1)
		return nil
	}), consumer.Recover(), consMemDedup(t, "test/idheader"))
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{IDHeader: "x-request-id"}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	consPublish(t, url, q,
		amqp091.Publishing{MessageId: "fallback", Headers: amqp091.Table{"x-request-id": int32(42)}, Body: []byte("1")},
		amqp091.Publishing{MessageId: "fallback-2", Headers: amqp091.Table{"x-request-id": ""}, Body: []byte("2")})
	testenv.Eventually(t, 30*time.Second, "2 settled deliveries", func() bool {
		st := c.Stats()
		return st.DeadLettered+st.Acked >= 2
	})
	stop()
	if n := ran.Load(); n != 0 {
		t.Errorf("the handler ran %d times, want 0", n)
	}
	dead := consGetAll(t, url, q+".dlq")
	if len(dead) != 2 {
		t.Fatalf("%d dead letters, want 2", len(dead))
	}
	for i, want := range []string{`header "x-request-id" holds a int32, not a string`, `header "x-request-id" is empty`} {
		d := dead[i]
		e, _ := d.Headers[consumer.HeaderError].(string)
		if d.Headers[consumer.HeaderReason] != string(consumer.OutcomeInvalidKey) || !strings.Contains(e, want) {
			t.Errorf("dead letter %s: %s %v, %s %q; want invalid_key, %q", d.MessageId, consumer.HeaderReason, d.Headers[consumer.HeaderReason], consumer.HeaderError, e, want)
		}
	}
}

// Every dead letter carries a message id that is the same for every
// delivery of the same message, so a reader of the dead-letter queue can
// deduplicate on it: the message-id when there is one, the IDHeader id,
// else one derived from the queue and the content. Two identical
// deliveries without id (as a redelivery after a worker died between the
// dead letter's confirm and its ack would be) get the same id; another
// message a different one.
func TestConsumerDeadLetterID(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		return consumer.Permanent(errors.New("cannot parse the payload"))
	}), consumer.Recover(), consMemDedup(t, "test/dlid"))
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{IDHeader: "x-request-id"}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	noID := amqp091.Publishing{Body: []byte("who am I"), Headers: amqp091.Table{"tenant": "t1"}}
	consPublish(t, url, q, noID, noID,
		amqp091.Publishing{Body: []byte("who am I"), Headers: amqp091.Table{"tenant": "t2"}},
		amqp091.Publishing{MessageId: "p-1", Body: []byte("p")},
		amqp091.Publishing{Headers: amqp091.Table{"x-request-id": "h-1"}, Body: []byte("h")})
	testenv.Eventually(t, 30*time.Second, "5 dead letters", func() bool { return c.Stats().DeadLettered >= 5 })
	stop()
	dead := consGetAll(t, url, q+".dlq")
	if len(dead) != 5 {
		t.Fatalf("%d dead letters, want 5", len(dead))
	}
	var ids []string
	for _, d := range dead {
		ids = append(ids, d.MessageId)
	}
	t.Logf("dead-letter ids %q", ids)
	if ids[0] == "" || ids[0] != ids[1] || ids[2] == "" || ids[2] == ids[0] || ids[3] != "p-1" || ids[4] != "h-1" {
		t.Errorf("dead-letter ids %q: want the first two equal and not empty, a third one, p-1 and h-1", ids)
	}
}

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// A graceful stop lets the running handler finish and acknowledges it; the
// prefetched deliveries no handler started go back to the queue.
func TestConsumerGracefulStop(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	started := make(chan struct{})
	release := make(chan struct{})
	var handled atomic.Int64
	h := consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
		if handled.Load() == 0 {
			close(started)
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		handled.Add(1)
		return nil
	})
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{Prefetch: 10}))
	if err != nil {
		t.Fatal(err)
	}
	workersStopped := consWorkersStopped(t, c)
	stop := consStart(t, c)
	consPublish(t, url, q, consMsgs("graceful", 5)...)
	<-started
	stopped := make(chan struct{})
	go func() { stop(); close(stopped) }()
	// The stop has cancelled the consumer and stopped the workers; Run
	// must still wait for the handler.
	workersStopped(stopped)
	select {
	case <-stopped:
		t.Fatal("Run returned while a handler was running")
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	<-stopped
	if n := handled.Load(); n != 1 {
		t.Errorf("%d handled, want 1", n)
	}
	st := c.Stats()
	if st.Acked != 1 {
		t.Errorf("Acked = %d, want 1 (stats %+v)", st.Acked, st)
	}
	if st.Requeued != 4 {
		t.Errorf("Requeued = %d, want 4", st.Requeued)
	}
	if n := consDepth(t, url, q); n != 4 {
		t.Errorf("%d messages in the queue after the stop, want 4", n)
	}
}

// close_all_connections (scoped to the test's vhost) twice during a
// 10,000-message run: the consumer reconnects, nothing is lost, and with
// pgtable no effect is applied twice.
func TestConsumerCloseAllConnections(t *testing.T) {
	t.Parallel()
	ctl := consRabbitmqctl(t)
	vh, url := consVhost(t, ctl)
	q := consQueue(t, url, consTestDelays)
	o := effectstest.New(t, 10)
	const n = 10000
	consPublish(t, url, q, consMsgs("m", n)...)
	c, err := NewConsumer(url, q, o.Handler(t, nil), consOpts(ConsumerOptions{Concurrency: 8, Prefetch: 100}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	for i, at := range []int{2000, 6000} {
		testenv.Eventually(t, 120*time.Second, "progress", func() bool { _, d := o.Counts(t); return d >= at })
		ctl("close_all_connections", "--vhost", vh, "idem test: connection kill mid-run")
		// The consumer reconnects even if the run finished while
		// rabbitmqctl started (a close on an idle connection).
		testenv.Eventually(t, 60*time.Second, "a reconnect", func() bool { return c.Stats().Connects >= int64(i+2) })
	}
	testenv.Eventually(t, 150*time.Second, "every message applied", func() bool { _, d := o.Counts(t); return d >= n })
	testenv.Eventually(t, 30*time.Second, "the queue to drain", func() bool { return consDepth(t, url, q) == 0 })
	stop()
	rows, distinct := o.Counts(t)
	st := c.Stats()
	t.Logf("%d messages, %d effect rows for %d ids; stats %+v", n, rows, distinct, st)
	if distinct != n {
		t.Errorf("%d of %d messages applied: %d lost", distinct, n, n-distinct)
	}
	if rows != distinct {
		t.Errorf("%d duplicate effects", rows-distinct)
	}
	if st.Connects < 3 {
		t.Errorf("Connects = %d, want at least 3", st.Connects)
	}
}

// A worker child process is killed with SIGKILL at least 20 times while it
// processes: with pgtable, every message is applied exactly once.
func TestConsumerChildSIGKILL(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	o := effectstest.New(t, 2)
	total := 3000
	consPublish(t, url, q, consMsgs("k0", total)...)
	const kills = 20
	for k, batch := 0, 1; k < kills; k++ {
		if _, d := o.Counts(t); d >= total-200 {
			consPublish(t, url, q, consMsgs(fmt.Sprintf("k%d", batch), 1000)...)
			total += 1000
			batch++
		}
		rows0, _ := o.Counts(t)
		cmd := consChildCommand(url, q, o.Schema)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// Killed at a random point of its work: once it applied a random
		// number of effects.
		more := rand.N(100)
		testenv.Eventually(t, 60*time.Second, "the child to apply effects", func() bool { r, _ := o.Counts(t); return r > rows0+more })
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}
	// The last child drains the queue and stops on SIGTERM.
	cmd := consChildCommand(url, q, o.Schema)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 120*time.Second, "every message applied", func() bool { _, d := o.Counts(t); return d >= total })
	testenv.Eventually(t, 30*time.Second, "the queue to drain", func() bool { return consDepth(t, url, q) == 0 })
	_ = cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Errorf("the last child: %v", err)
	}
	rows, distinct := o.Counts(t)
	t.Logf("%d messages, %d SIGKILLs: %d effect rows for %d ids", total, kills, rows, distinct)
	if distinct != total {
		t.Errorf("%d of %d messages applied: %d lost", distinct, total, total-distinct)
	}
	if rows != distinct {
		t.Errorf("%d duplicate effects", rows-distinct)
	}
}

// The broker cancels the consumer when its queue is deleted (basic.cancel):
// the Consumer reconnects, declares the queue again and consumes what is
// published to it afterwards, instead of idling until its context ends.
func TestConsumerBrokerCancel(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	var handled atomic.Int64
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { handled.Add(1); return nil })
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{Concurrency: 2}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	consPublish(t, url, q, consMsgs("before", 1)...)
	testenv.Eventually(t, 30*time.Second, "the first message acked", func() bool { return c.Stats().Acked == 1 })
	consAdmin(t, url, func(ch *amqp091.Channel) error { _, err := ch.QueueDelete(q, false, false, false); return err })
	testenv.Eventually(t, 30*time.Second, "a reconnect after the broker cancelled the consumer", func() bool { return c.Stats().Connects >= 2 })
	consPublish(t, url, q, consMsgs("after", 1)...)
	testenv.Eventually(t, 30*time.Second, "the message published after the reconnect acked", func() bool { return c.Stats().Acked == 2 })
	stop()
	if n := handled.Load(); n != 2 {
		t.Fatalf("handled %d messages, want 2", n)
	}
}

// Poison messages whose dead-letter copies the broker refuses at first (a
// policy makes the dead-letter queue reject publishes, so the confirms are
// nacks): each such delivery is requeued and reported once, as a retry,
// never as a dead letter; once the policy is gone, each message is
// dead-lettered, and reported as a dead letter, exactly once. Every
// delivery handed to the chain is reported once.
func TestConsumerOutcomeOnceWhenDeadLetterUnconfirmed(t *testing.T) {
	t.Parallel()
	ctl := consRabbitmqctl(t)
	vh, url := consVhost(t, ctl)
	q := consQueue(t, url, consTestDelays)
	ctl("set_policy", "-p", vh, "--apply-to", "queues", "refuse-dead-letters", "^"+q+`\.dlq$`,
		`{"max-length":0,"overflow":"reject-publish"}`)
	h := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		if strings.HasPrefix(msg.ID, "poison-") {
			return consumer.Permanent(errors.New("poison"))
		}
		return nil
	})
	var (
		mu        sync.Mutex
		reports   int
		deadRep   = map[string]int{}
		claimDead int // reports that name the dead-letter reason without a dead letter
		unconf    int
	)
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{
		Telemetry: consumer.Telemetry{
			OnOutcome: func(_ context.Context, r consumer.Report) {
				mu.Lock()
				defer mu.Unlock()
				reports++
				switch {
				case r.Result.Action == consumer.ActionDeadLetter:
					deadRep[r.Message.ID]++
				case r.Result.Reason == consumer.OutcomePermanent || r.Outcome == consumer.OutcomePermanent:
					claimDead++
				case r.Result.Action == consumer.ActionRetry && errors.Is(r.Err, errUnpublished):
					unconf++
				}
			},
		},
	}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	const poison = 3
	consPublish(t, url, q, consMsgs("poison", poison)...)
	consPublish(t, url, q, consMsgs("ok", 5)...)
	testenv.Eventually(t, 60*time.Second, "every poison message requeued once", func() bool { return c.Stats().Requeued >= poison })
	ctl("clear_policy", "-p", vh, "refuse-dead-letters")
	testenv.Eventually(t, 60*time.Second, "the poison messages dead-lettered", func() bool { return consDepth(t, url, q+".dlq") >= poison })
	stop()
	st := c.Stats()
	mu.Lock()
	defer mu.Unlock()
	t.Logf("stats %+v; %d reports: dead letters %v, %d unconfirmed retries, %d claiming a dead letter", st, reports, deadRep, unconf, claimDead)
	if int64(reports) != st.Delivered {
		t.Errorf("%d reports for %d deliveries, want one each", reports, st.Delivered)
	}
	dead := consGetAll(t, url, q+".dlq")
	if len(dead) != poison || len(deadRep) != poison {
		t.Errorf("%d dead letters, %d messages reported dead-lettered; want %d each", len(dead), len(deadRep), poison)
	}
	for id, n := range deadRep {
		if n != 1 {
			t.Errorf("%s reported dead-lettered %d times, want once", id, n)
		}
	}
	if claimDead != 0 {
		t.Errorf("%d reports of requeued deliveries name the dead letter's reason", claimDead)
	}
	if int64(unconf) != st.Requeued || st.DeadLettered != poison {
		t.Errorf("%d unconfirmed retries reported, %d requeued, %d dead-lettered; want as many reported as requeued and %d dead letters", unconf, st.Requeued, st.DeadLettered, poison)
	}
}

// A handler that settles its own delivery (DeliveryFrom, then Ack, Nack or
// Reject): the call is refused with ErrSettledByHandler and sends nothing,
// the Consumer settles the delivery as usual, and Run goes on: no channel
// error, every message acknowledged once, the counts true.
func TestConsumerHandlerSettlesItsDelivery(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	var refused, accepted atomic.Int64
	h := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		d, ok := DeliveryFrom(ctx)
		if !ok {
			return errors.New("no delivery in the context")
		}
		var err error
		switch {
		case strings.HasPrefix(msg.ID, "ack-"):
			err = d.Ack(false)
		case strings.HasPrefix(msg.ID, "nack-"):
			err = d.Nack(false, true)
		default:
			err = d.Reject(false)
		}
		if errors.Is(err, ErrSettledByHandler) {
			refused.Add(1)
		} else {
			accepted.Add(1)
		}
		return nil
	})
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{Concurrency: 4, Prefetch: 20}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	const each = 10
	consPublish(t, url, q, consMsgs("ack", each)...)
	consPublish(t, url, q, consMsgs("nack", each)...)
	consPublish(t, url, q, consMsgs("reject", each)...)
	testenv.Eventually(t, 60*time.Second, "every message acknowledged", func() bool { return c.Stats().Acked >= 3*each })
	stop() // fails the test if Run returned an error
	st := c.Stats()
	t.Logf("stats %+v; %d settlements refused, %d accepted", st, refused.Load(), accepted.Load())
	if accepted.Load() != 0 || refused.Load() != 3*each {
		t.Errorf("%d of the handler's settlements went through, %d refused; want all %d refused", accepted.Load(), refused.Load(), 3*each)
	}
	if st.Acked != 3*each || st.Delivered != 3*each || st.Connects != 1 || st.Abandoned != 0 {
		t.Errorf("stats %+v: want %d delivered and acknowledged on one connection", st, 3*each)
	}
	if n := consDepth(t, url, q); n != 0 {
		t.Errorf("%d messages back in the queue", n)
	}
}
