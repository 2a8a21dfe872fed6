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
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/testkit/effectstest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestConsumerInFlightDefaults(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ prefetch, concurrency, inFlight, want int }{
		{0, 0, 0, 1},      // one handler keeps the order: nothing beside it
		{0, 1, 0, 1},      //
		{0, 8, 0, 64},     // 8 × Concurrency
		{100, 16, 0, 100}, // at most Prefetch
		{10, 16, 0, 16},   // but never below Concurrency
		{100, 8, 8, 8},    // as given: no gate
		{100, 1, 50, 50},  // as given: one handler, 50 deliveries in store calls
	} {
		o := ConsumerOptions{Prefetch: c.prefetch, Concurrency: c.concurrency, InFlight: c.inFlight}
		if err := o.consSetDefaults("q"); err != nil {
			t.Fatalf("%+v: %v", c, err)
		}
		if o.InFlight != c.want {
			t.Errorf("Prefetch %d, Concurrency %d, InFlight %d: InFlight became %d, want %d", c.prefetch, c.concurrency, c.inFlight, o.InFlight, c.want)
		}
	}
}

// peakCounter counts calls in progress and remembers the most at once.
type peakCounter struct {
	mu        sync.Mutex
	now, peak int
}

func (p *peakCounter) enter() {
	p.mu.Lock()
	p.now++
	p.peak = max(p.peak, p.now)
	p.mu.Unlock()
}

func (p *peakCounter) leave() {
	p.mu.Lock()
	p.now--
	p.mu.Unlock()
}

func (p *peakCounter) max() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.peak
}

// slowDedup is consumer.Dedup in scope over a slowStore whose calls take
// 20ms, on a memstore closed with the test.
func slowDedup(t *testing.T, scope string) (*slowStore, consumer.Middleware) {
	t.Helper()
	mem, err := memstore.New(memstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mem.Close() })
	store := &slowStore{LeaseStore: mem, delay: 20 * time.Millisecond}
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: scope})
	if err != nil {
		t.Fatal(err)
	}
	return store, dd
}

// slowStore is a real memstore whose claims and completes take a while, as
// a store a round trip away does.
type slowStore struct {
	dedup.LeaseStore
	delay  time.Duration
	claims peakCounter
	// held counts the leases granted and not yet completed or released.
	held atomic.Int64
}

func (s *slowStore) Claim(ctx context.Context, k dedup.Key) (*dedup.Lease, error) {
	s.claims.enter()
	defer s.claims.leave()
	time.Sleep(s.delay)
	l, err := s.LeaseStore.Claim(ctx, k)
	if err == nil {
		s.held.Add(1)
	}
	return l, err
}

func (s *slowStore) Complete(ctx context.Context, l *dedup.Lease, r []byte) error {
	time.Sleep(s.delay)
	err := s.LeaseStore.Complete(ctx, l, r)
	if err == nil {
		s.held.Add(-1)
	}
	return err
}

func (s *slowStore) Release(ctx context.Context, l *dedup.Lease) error {
	err := s.LeaseStore.Release(ctx, l)
	if err == nil {
		s.held.Add(-1)
	}
	return err
}

// TestConsumerInFlightBoundsHandlersNotStoreCalls runs 2 handlers and 8
// deliveries in flight over a store whose calls take 20ms: the claims
// overlap beyond the 2 handlers, the handlers never do, and every message
// is applied once (oracle).
func TestConsumerInFlightBoundsHandlersNotStoreCalls(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	o := effectstest.New(t, 4)
	store, dd := slowDedup(t, "inflight")
	var handlers peakCounter
	var handled atomic.Int64
	h := consumer.Chain(o.Handler(t, func(context.Context, *consumer.Message) error {
		handlers.enter()
		defer handlers.leave()
		time.Sleep(2 * time.Millisecond)
		handled.Add(1)
		return nil
	}), consumer.Recover(), dd)
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{Concurrency: 2, InFlight: 8, Prefetch: 50}))
	if err != nil {
		t.Fatal(err)
	}
	const n = 64
	consPublish(t, url, q, consMsgs("inflight", n)...)
	stop := consStart(t, c)
	testenv.Eventually(t, 60*time.Second, "every message acked", func() bool { return c.Stats().Acked >= n })
	stop()
	rows, distinct := o.Counts(t)
	if rows != n || distinct != n {
		t.Fatalf("effects: %d rows for %d ids, want %d for %d", rows, distinct, n, n)
	}
	if got := handlers.max(); got > 2 {
		t.Errorf("%d handlers ran at once; want at most Concurrency, 2", got)
	}
	if got := store.claims.max(); got <= 2 {
		t.Errorf("at most %d claims were in flight at once; want more than the 2 handlers (InFlight 8)", got)
	}
	t.Logf("peaks: %d handlers, %d claims; stats %+v", handlers.max(), store.claims.max(), c.Stats())
}

// A graceful stop starts no handler: deliveries that claimed their key and
// wait for a handler slot give the key back and are requeued with the
// prefetched ones, while the running handlers finish and are acked.
func TestConsumerInFlightGracefulStop(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	// Claims that take a while: while one runs, its seat is free for
	// the next delivery to start its own, so all 8 claim.
	cs, dd := slowDedup(t, "stop")
	var started, stopping atomic.Int64
	release := make(chan struct{})
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
		started.Add(1)
		if stopping.Load() > 0 {
			t.Error("a handler started after the stop")
		}
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil
	}), consumer.Recover(), dd)
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{Concurrency: 2, InFlight: 8, Prefetch: 20, ShutdownTimeout: 10 * time.Second}))
	if err != nil {
		t.Fatal(err)
	}
	const n = 12
	consPublish(t, url, q, consMsgs("stop", n)...)
	workersStopped := consWorkersStopped(t, c)
	stop := consStart(t, c)
	// 2 handlers running, 6 more deliveries claimed and waiting for a slot.
	testenv.Eventually(t, 30*time.Second, "2 handlers running and 6 deliveries waiting for a slot", func() bool {
		return started.Load() == 2 && cs.held.Load() == 8
	})
	stopping.Store(1)
	consStopThenRelease(stop, workersStopped, release)
	st := c.Stats()
	t.Logf("stats %+v", st)
	if started.Load() != 2 || st.Acked != 2 || st.Requeued != n-2 || st.Abandoned != 0 {
		t.Errorf("started %d, stats %+v: want 2 started and acked, %d requeued, 0 abandoned", started.Load(), st, n-2)
	}
	if got := consDepth(t, url, q); got != n-2 {
		t.Errorf("%d messages in the queue after the stop, want %d", got, n-2)
	}
	// The keys of the requeued deliveries were given back: their
	// redeliveries run at once.
	if f := cs.held.Load(); f != 0 {
		t.Errorf("%d keys still in flight after the stop, want 0", f)
	}
}

// heldKey returns a memstore, Dedup in scope over it, and the lease of a
// claim on (scope, id, body) that another owner holds until release is
// called.
func heldKey(t *testing.T, scope, id string, body []byte) (mw consumer.Middleware, release func()) {
	t.Helper()
	mem, err := memstore.New(memstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mem.Close() })
	l, err := mem.Claim(context.Background(), dedup.NewKey(scope, id, body))
	if err != nil {
		t.Fatal(err)
	}
	mw, err = consumer.Dedup(mem, consumer.DedupOptions{Scope: scope})
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	return mw, func() {
		once.Do(func() {
			if err := mem.Release(context.Background(), l); err != nil {
				t.Error(err)
			}
		})
	}
}

// A message whose key another owner holds waits in the retry queues
// without spending its attempts: after three in_flight retries the key is
// released, and the handler, which always fails, still runs MaxAttempts
// times before the message is dead-lettered with retries_exhausted. The
// dead letter counts the waits in HeaderWaits.
func TestConsumerWaitsDoNotSpendAttempts(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	body := []byte("charge 10 EUR")
	dd, release := heldKey(t, "test/wait", "held", body)
	var (
		mu       sync.Mutex
		attempts []int
	)
	h := consumer.Chain(consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		mu.Lock()
		attempts = append(attempts, msg.Attempt)
		mu.Unlock()
		return errors.New("downstream unavailable")
	}), consumer.Recover(), dd)
	var waits atomic.Int64
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{MaxAttempts: 3,
		Telemetry: consumer.Telemetry{
			OnOutcome: func(_ context.Context, r consumer.Report) {
				if r.Result.Reason == consumer.OutcomeInFlight && r.Result.Action == consumer.ActionRetry && waits.Add(1) == 3 {
					release()
				}
			},
		},
	}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	consPublish(t, url, q, amqp091.Publishing{MessageId: "held", Body: body})
	testenv.Eventually(t, 30*time.Second, "the dead letter", func() bool { return c.Stats().DeadLettered >= 1 })
	stop()
	mu.Lock()
	defer mu.Unlock()
	if !equalInts(attempts, []int{1, 2, 3}) {
		t.Errorf("handler attempts %v after %d waits, want [1 2 3] (MaxAttempts)", attempts, waits.Load())
	}
	dead := consGetAll(t, url, q+".dlq")
	if len(dead) != 1 {
		t.Fatalf("%d dead letters, want 1", len(dead))
	}
	d := dead[0]
	n, _ := consHeaderInt(d.Headers[HeaderAttempt])
	w, _ := consHeaderInt(d.Headers[HeaderWaits])
	if d.Headers[consumer.HeaderReason] != string(consumer.OutcomeRetriesExhausted) || n != 3 || w != 3 {
		t.Errorf("dead letter: %s %v, %s %d, %s %d; want retries_exhausted, 3, 3", consumer.HeaderReason, d.Headers[consumer.HeaderReason], HeaderAttempt, n, HeaderWaits, w)
	}
}

// The waits for a key another owner holds are bounded by MaxWait: with a
// key held all along and a MaxWait shorter than the retry delay, the first
// wait goes through the retry queue and the second dead-letters the
// message with reason wait_limit, without its handler running, and the
// dead letter says why.
func TestConsumerMaxWait(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	body := []byte("charge 10 EUR")
	dd, _ := heldKey(t, "test/maxwaits", "stuck", body)
	var ran atomic.Int64
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		ran.Add(1)
		return nil
	}), consumer.Recover(), dd)
	var verdict atomic.Value
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{MaxWait: time.Millisecond,
		Telemetry: consumer.Telemetry{
			OnOutcome: func(_ context.Context, r consumer.Report) {
				if r.Result.Action == consumer.ActionDeadLetter {
					res, reason := verdictOf(r.Result)
					verdict.Store(res + " " + reason)
				}
			},
		},
	}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	consPublish(t, url, q, amqp091.Publishing{MessageId: "stuck", Body: body})
	testenv.Eventually(t, 30*time.Second, "the dead letter", func() bool { return c.Stats().DeadLettered >= 1 })
	stop()
	if st := c.Stats(); st.Retried != 1 || ran.Load() != 0 {
		t.Errorf("%d waits, handler ran %d times; want 1 and 0 (stats %+v)", st.Retried, ran.Load(), st)
	}
	if v := verdict.Load(); v != "dead_letter "+string(ReasonWaitLimit) {
		t.Errorf("verdict %v, want dead_letter %s", v, ReasonWaitLimit)
	}
	dead := consGetAll(t, url, q+".dlq")
	if len(dead) != 1 {
		t.Fatalf("%d dead letters, want 1", len(dead))
	}
	d := dead[0]
	e, _ := d.Headers[consumer.HeaderError].(string)
	if d.Headers[consumer.HeaderReason] != string(ReasonWaitLimit) || !strings.Contains(e, "MaxWait 1ms") || !strings.Contains(e, "in flight") {
		t.Errorf("dead letter: %s %v, %s %q", consumer.HeaderReason, d.Headers[consumer.HeaderReason], consumer.HeaderError, e)
	}
	if n, _ := consHeaderInt(d.Headers[HeaderAttempt]); n > 1 {
		t.Errorf("dead letter %s = %d; waits must not count as attempts", HeaderAttempt, n)
	}
}
