package idemamqp

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/effectstest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// These tests check the ACK coalescing (consAcker) on the real broker: a
// multiple ack never covers a delivery still in flight or settled some
// other way, finished deliveries behind a slow one do not wait forever, a
// graceful stop sends what waits, and a closed channel gives back exactly
// the deliveries that were not acknowledged.

// consCounts returns a function that reads a queue's ready and
// unacknowledged message counts from the broker (rabbitmqctl list_queues:
// the broker's own count, which no client can see otherwise).
func consCounts(t *testing.T, rawURL string) func(queue string) (ready, unacked int) {
	t.Helper()
	consRabbitmqctl(t) // skips (fails under CI) when rabbitmqctl cannot be used
	u, err := amqp091.ParseURI(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	bin, err := exec.LookPath("rabbitmqctl")
	if err != nil {
		bin = "/usr/sbin/rabbitmqctl"
	}
	return func(queue string) (int, int) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, bin, "--quiet", "list_queues", "-p", u.Vhost,
			"name", "messages_ready", "messages_unacknowledged").CombinedOutput()
		if err != nil {
			t.Fatalf("rabbitmqctl list_queues: %v: %s", err, out)
		}
		for line := range strings.Lines(string(out)) {
			f := strings.Fields(line)
			if len(f) == 3 && f[0] == queue {
				ready, err1 := strconv.Atoi(f[1])
				unacked, err2 := strconv.Atoi(f[2])
				if err1 != nil || err2 != nil {
					t.Fatalf("rabbitmqctl list_queues: %q", line)
				}
				return ready, unacked
			}
		}
		t.Fatalf("queue %s not in rabbitmqctl list_queues: %s", queue, out)
		return 0, 0
	}
}

// consRuns counts handler runs per message id.
type consRuns struct {
	mu   sync.Mutex
	runs map[string]int
}

func (r *consRuns) add(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.runs == nil {
		r.runs = map[string]int{}
	}
	r.runs[id]++
	return r.runs[id]
}

func (r *consRuns) get(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.runs[id]
}

func (r *consRuns) total() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, v := range r.runs {
		n += v
	}
	return n
}

// A slow delivery at the lowest tag, 30 fast ones after it: the fast ones
// are acknowledged (on their own, once they waited the bound) while the
// slow one runs, and the slow one is not — the broker holds exactly one
// unacknowledged message. When its channel then closes, only the slow
// message comes back.
func TestConsumerAckSlowLowTag(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	counts := consCounts(t, url)
	q := consQueue(t, url, consTestDelays)
	const fast = 30
	var (
		runs    consRuns
		slowCh  atomic.Pointer[amqp091.Channel]
		started = make(chan struct{})
		release = make(chan struct{})
	)
	h := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		n := runs.add(msg.ID)
		if msg.ID == "slow-0" && n == 1 {
			d, _ := DeliveryFrom(ctx)
			slowCh.Store(consChannel(d))
			close(started)
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	})
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{Concurrency: 4, Prefetch: 100, ShutdownTimeout: time.Second}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	// One publish, in order: slow-0 has the lowest delivery tag.
	consPublish(t, url, q, append(consMsgs("slow", 1), consMsgs("fast", fast)...)...)
	<-started
	waitStart := time.Now()
	testenv.Eventually(t, 30*time.Second, "the fast deliveries to be acknowledged while the slow one runs",
		func() bool { return c.Stats().Acked == fast })
	t.Logf("the %d fast deliveries were acknowledged %v after the slow one started", fast, time.Since(waitStart).Round(time.Millisecond))
	testenv.Eventually(t, 30*time.Second, "the broker to count 1 unacknowledged message", func() bool {
		ready, unacked := counts(q)
		return ready == 0 && unacked == 1
	})
	time.Sleep(200 * time.Millisecond)
	if ready, unacked := counts(q); ready != 0 || unacked != 1 {
		t.Fatalf("while the slow delivery runs: %d ready, %d unacknowledged; want 0 and 1", ready, unacked)
	}
	// The channel dies under the slow handler; then it finishes.
	if err := slowCh.Load().Close(); err != nil {
		t.Fatal(err)
	}
	close(release)
	testenv.Eventually(t, 30*time.Second, "the slow message to come back and be acknowledged", func() bool { return c.Stats().Acked == fast+1 })
	stop()
	st := c.Stats()
	t.Logf("stats %+v", st)
	if n := runs.get("slow-0"); n != 2 {
		t.Errorf("slow-0 ran %d times, want 2 (its first delivery died unacknowledged)", n)
	}
	for i := range fast {
		if n := runs.get(fmt.Sprintf("fast-%d", i)); n != 1 {
			t.Errorf("fast-%d ran %d times, want 1", i, n)
		}
	}
	if st.Delivered != fast+2 || st.Redelivered != 1 || st.Abandoned != 1 || st.Acked != fast+1 || st.Connects < 2 {
		t.Errorf("stats %+v: want %d delivered, 1 redelivered, 1 abandoned, %d acked, 2+ connects", st, fast+2, fast+1)
	}
	if n := consDepth(t, url, q); n != 0 {
		t.Errorf("%d messages left in the queue", n)
	}
}

// One prefetch window holds deliveries acknowledged at once, duplicates,
// deliveries retried through a retry queue and dead-lettered ones,
// finishing in random order: each is settled exactly as without
// coalescing — no channel error (a multiple ack over a tag settled some
// other way would be "unknown delivery tag"), no redelivery, exact counts,
// every dead letter once, nothing left behind.
func TestConsumerAckMixedWindow(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	var (
		runs     consRuns
		mu       sync.Mutex
		attempts = map[string][]int{}
	)
	inner := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		runs.add(msg.ID)
		mu.Lock()
		attempts[msg.ID] = append(attempts[msg.ID], msg.Attempt)
		mu.Unlock()
		time.Sleep(time.Duration(rand.N(3000)) * time.Microsecond) // finish out of order
		switch {
		case strings.HasPrefix(msg.ID, "perm-"):
			return consumer.Permanent(errors.New("cannot parse"))
		case strings.HasPrefix(msg.ID, "flaky-") && msg.Attempt == 1:
			return errors.New("downstream unavailable")
		}
		return nil
	})
	h := consumer.Chain(inner, consumer.Recover(), consMemDedup(t, "test/mixed"))
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{Concurrency: 8, Prefetch: 50, MaxAttempts: 3}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	// First the originals of the duplicates, done before the window.
	pre := consMsgs("pre", 6)
	consPublish(t, url, q, pre...)
	testenv.Eventually(t, 30*time.Second, "the originals", func() bool { return c.Stats().Acked == 6 })
	var window []amqp091.Publishing
	ok, perm, flaky := consMsgs("ok", 24), consMsgs("perm", 8), consMsgs("flaky", 8)
	for i := range 24 {
		window = append(window, ok[i])
		switch i % 3 {
		case 0:
			window = append(window, perm[i/3])
		case 1:
			window = append(window, flaky[i/3])
		case 2:
			window = append(window, pre[i/3%6])
		}
	}
	consPublish(t, url, q, window...)
	const wantAcked = 6 + 24 + 8 + 8 // originals, ok, duplicates, flaky on attempt 2
	testenv.Eventually(t, 30*time.Second, "every verdict", func() bool {
		st := c.Stats()
		return st.Acked >= wantAcked && st.DeadLettered >= 8
	})
	stop()
	st := c.Stats()
	t.Logf("stats %+v", st)
	want := ConsumerStats{Delivered: 6 + 24 + 8 + 8*2 + 8, Acked: wantAcked, Duplicates: 8, Retried: 8, DeadLettered: 8, Connects: 1}
	if st != want {
		t.Errorf("stats\n got %+v\nwant %+v", st, want)
	}
	for id, n := range map[string]int{"ok": 1, "perm": 1, "flaky": 2, "pre": 1} {
		for i := range map[string]int{"ok": 24, "perm": 8, "flaky": 8, "pre": 6}[id] {
			if got := runs.get(fmt.Sprintf("%s-%d", id, i)); got != n {
				t.Errorf("%s-%d ran %d times, want %d", id, i, got, n)
			}
		}
	}
	mu.Lock()
	for i := range 8 {
		if a := attempts[fmt.Sprintf("flaky-%d", i)]; !slices.Equal(a, []int{1, 2}) {
			t.Errorf("flaky-%d attempts %v, want [1 2]", i, a)
		}
	}
	mu.Unlock()
	dead := consGetAll(t, url, q+".dlq")
	var ids []string
	for _, d := range dead {
		ids = append(ids, d.MessageId)
		if d.Headers[consumer.HeaderReason] != "permanent" {
			t.Errorf("dead letter %s: reason %v", d.MessageId, d.Headers[consumer.HeaderReason])
		}
	}
	slices.Sort(ids)
	var wantIDs []string
	for _, m := range perm {
		wantIDs = append(wantIDs, m.MessageId)
	}
	slices.Sort(wantIDs)
	if !slices.Equal(ids, wantIDs) {
		t.Errorf("dead letters %v, want %v", ids, wantIDs)
	}
	if left := consGetAll(t, url, q); len(left) != 0 {
		t.Errorf("%d messages came back to the queue after the stop", len(left))
	}
	for _, d := range consTestDelays {
		if n := consDepth(t, url, consRetryQueue(q, d)); n != 0 {
			t.Errorf("%d messages left in %s", n, consRetryQueue(q, d))
		}
	}
}

// A graceful stop sends the acks still being coalesced before it closes
// the connection. With the linger and the bound set to an hour, the
// finished deliveries' acks wait (the broker counts them unacknowledged)
// until the stop; the prefetched deliveries no handler started are nacked
// back meanwhile. After Run returned, exactly the unstarted messages are in
// the queue, and none of the handled ones came back. The first quick
// handlers to start return at once and the next two block (by start order:
// the handler seats are not handed out in delivery order).
func TestConsumerAckShutdownFlush(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	counts := consCounts(t, url)
	q := consQueue(t, url, consTestDelays)
	const n, quick = 20, 5
	consPublish(t, url, q, consMsgs("m", n)...)
	var (
		runs    consRuns
		starts  atomic.Int32
		blocked atomic.Int32
		release = make(chan struct{})
	)
	h := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		runs.add(msg.ID)
		if starts.Add(1) > quick {
			blocked.Add(1)
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	})
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{Concurrency: 2, Prefetch: 100, ShutdownTimeout: 5 * time.Second}))
	if err != nil {
		t.Fatal(err)
	}
	c.ackLinger, c.ackDelay = time.Hour, time.Hour
	workersStopped := consWorkersStopped(t, c)
	stop := consStart(t, c)
	testenv.Eventually(t, 30*time.Second, "5 handled and 2 handlers blocked", func() bool { return runs.total() == quick+2 && blocked.Load() == 2 })
	testenv.Eventually(t, 30*time.Second, "all 20 delivered and unacknowledged", func() bool {
		ready, unacked := counts(q)
		return ready == 0 && unacked == n
	})
	if st := c.Stats(); st.Acked != 0 {
		t.Fatalf("Acked = %d before the stop; the acks should wait (linger of an hour)", st.Acked)
	}
	consStopThenRelease(stop, workersStopped, release)
	st := c.Stats()
	t.Logf("stats %+v", st)
	if st.Acked != quick+2 || st.Requeued != n-quick-2 || st.Abandoned != 0 || st.Delivered != quick+2 {
		t.Errorf("stats %+v: want %d acked, %d requeued, 0 abandoned, %d delivered", st, quick+2, n-quick-2, quick+2)
	}
	left := consGetAll(t, url, q)
	var ids []string
	for _, d := range left {
		ids = append(ids, d.MessageId)
	}
	slices.Sort(ids)
	var want []string
	for i := range n {
		if id := fmt.Sprintf("m-%d", i); runs.get(id) == 0 {
			want = append(want, id)
		}
	}
	slices.Sort(want)
	if !slices.Equal(ids, want) {
		t.Errorf("after the stop the queue holds %v, want exactly the unstarted %v", ids, want)
	}
}

// A channel closed mid-run gives back exactly the deliveries that were not
// acknowledged: a0..a9 were acknowledged (their run lingered 50ms), the
// slow one and b0..b9 behind it were not (the bound is an hour), so those
// eleven are redelivered and acknowledged as duplicates; the oracle
// (consumer.Transactional on pgtable, an effects table without a unique
// constraint) shows each effect once and none lost.
func TestConsumerAckChannelClosedRedeliversUnacked(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	o := effectstest.New(t, 6)
	var (
		slowCh  atomic.Pointer[amqp091.Channel]
		started = make(chan struct{})
		release = make(chan struct{})
		first   atomic.Bool
	)
	inner := o.Handler(t, func(ctx context.Context, msg *consumer.Message) error {
		if msg.ID == "slow-0" && first.CompareAndSwap(false, true) {
			d, _ := DeliveryFrom(ctx)
			slowCh.Store(consChannel(d))
			close(started)
			select { // the effect commits after the channel died
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	})
	var (
		mu          sync.Mutex
		redelivered []string
		finished    atomic.Int32
	)
	h := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		if msg.Redelivered {
			mu.Lock()
			redelivered = append(redelivered, msg.ID)
			mu.Unlock()
		}
		err := inner.Handle(ctx, msg)
		finished.Add(1)
		return err
	})
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{Concurrency: 4, Prefetch: 100, ShutdownTimeout: time.Second}))
	if err != nil {
		t.Fatal(err)
	}
	c.ackLinger, c.ackDelay = 50*time.Millisecond, time.Hour
	stop := consStart(t, c)
	consPublish(t, url, q, consMsgs("a", 10)...)
	testenv.Eventually(t, 30*time.Second, "a0..a9 acknowledged", func() bool { return c.Stats().Acked == 10 })
	consPublish(t, url, q, append(consMsgs("slow", 1), consMsgs("b", 10)...)...)
	<-started
	testenv.Eventually(t, 30*time.Second, "b0..b9 handled", func() bool { return finished.Load() == 20 })
	if st := c.Stats(); st.Acked != 10 {
		t.Fatalf("Acked = %d with the slow delivery in flight, want 10: b0..b9 must wait behind it", st.Acked)
	}
	if err := slowCh.Load().Close(); err != nil {
		t.Fatal(err)
	}
	close(release)
	testenv.Eventually(t, 30*time.Second, "the 11 redeliveries acknowledged", func() bool { return c.Stats().Acked == 21 })
	stop()
	st := c.Stats()
	t.Logf("stats %+v", st)
	mu.Lock()
	slices.Sort(redelivered)
	want := []string{"b-0", "b-1", "b-2", "b-3", "b-4", "b-5", "b-6", "b-7", "b-8", "b-9", "slow-0"}
	if !slices.Equal(redelivered, want) {
		t.Errorf("redelivered %v, want exactly the unacknowledged %v", redelivered, want)
	}
	mu.Unlock()
	rows, distinct := o.Counts(t)
	if rows != 21 || distinct != 21 {
		t.Errorf("effects: %d rows for %d ids, want 21 for 21", rows, distinct)
	}
	if st.Delivered != 32 || st.Redelivered != 11 || st.Acked != 21 || st.Duplicates != 11 || st.Abandoned != 11 || st.Connects < 2 {
		t.Errorf("stats %+v: want 32 delivered, 11 redelivered, 21 acked, 11 duplicates, 11 abandoned, 2+ connects", st)
	}
	if n := consDepth(t, url, q); n != 0 {
		t.Errorf("%d messages left in the queue", n)
	}
}

// Handlers close their own channel now and then during a 3,000-message
// run with 8 handlers: every message is applied once (oracle), none is
// lost, and every delivery is accounted for as acknowledged or abandoned.
func TestConsumerAckChannelClosedStress(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	o := effectstest.New(t, 10)
	const n = 3000
	closers := map[string]bool{"m-400": true, "m-1100": true, "m-1900": true, "m-2600": true}
	var closed sync.Map
	h := o.Handler(t, func(ctx context.Context, msg *consumer.Message) error {
		if closers[msg.ID] {
			if _, again := closed.LoadOrStore(msg.ID, true); !again {
				d, _ := DeliveryFrom(ctx)
				return consChannel(d).Close()
			}
		}
		return nil
	})
	consPublish(t, url, q, consMsgs("m", n)...)
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{Concurrency: 8, Prefetch: 100}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	testenv.Eventually(t, 120*time.Second, "every message applied", func() bool { _, d := o.Counts(t); return d >= n })
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
	if st.Delivered != st.Acked+st.Abandoned+st.Requeued {
		t.Errorf("%d delivered, but %d acked + %d abandoned + %d requeued", st.Delivered, st.Acked, st.Abandoned, st.Requeued)
	}
	if st.Connects != 1+int64(len(closers)) || st.Abandoned < int64(len(closers)) {
		t.Errorf("stats %+v: want %d connects and at least %d abandoned", st, 1+len(closers), len(closers))
	}
	if left := consGetAll(t, url, q); len(left) != 0 {
		t.Errorf("%d messages came back after the stop", len(left))
	}
}
