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
	"syscall"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/testkit/effectstest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestConsumerQuorumOptions(t *testing.T) {
	t.Parallel()
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	url := testenv.AMQPURL()
	for name, o := range map[string]ConsumerOptions{
		"quorum not durable":    {QuorumQueue: true, NotDurable: true},
		"quorum classic args":   {QuorumQueue: true, QueueArgs: amqp091.Table{"x-queue-type": "classic"}},
		"negative deliveries":   {MaxDeliveries: -2},
		"negative deliveries 2": {MaxDeliveries: -100},
	} {
		if _, err := NewConsumer(url, "q", h, o); err == nil {
			t.Errorf("%s: NewConsumer accepted it", name)
		}
	}
	args := amqp091.Table{"x-max-length": int32(10)}
	c, err := NewConsumer(url, "q", h, ConsumerOptions{QuorumQueue: true, QueueArgs: args})
	if err != nil {
		t.Fatal(err)
	}
	if c.opts.QueueArgs["x-queue-type"] != "quorum" || c.opts.QueueArgs["x-max-length"] != int32(10) || len(args) != 1 {
		t.Errorf("QueueArgs %v (caller's %v)", c.opts.QueueArgs, args)
	}
	if c.opts.MaxDeliveries != 10 {
		t.Errorf("default MaxDeliveries %d, want 10", c.opts.MaxDeliveries)
	}
	for _, tc := range []struct {
		max   int
		count any
		want  bool
	}{
		{10, nil, false}, {10, int32(9), false}, {10, int32(10), true}, {10, int64(11), true},
		{1, int32(1), true}, {-1, int64(1000), false}, {10, "10", false},
	} {
		c.opts.MaxDeliveries = tc.max
		d := amqp091.Delivery{Headers: amqp091.Table{}}
		if tc.count != nil {
			d.Headers[HeaderDeliveryCount] = tc.count
		}
		if _, got := c.overDelivered(&d); got != tc.want {
			t.Errorf("MaxDeliveries %d, x-delivery-count %v: overDelivered %v, want %v", tc.max, tc.count, got, tc.want)
		}
	}
	p := c.copyOf(&amqp091.Delivery{Headers: amqp091.Table{HeaderDeliveryCount: int32(3), "k": "v"}}, 2)
	if _, ok := p.Headers[HeaderDeliveryCount]; ok || p.Headers["k"] != "v" {
		t.Errorf("copy headers %v: want x-delivery-count stripped, the others kept", p.Headers)
	}
}

// A message that "crashes" its worker every time (the handler closes the
// delivery's channel, so the delivery dies unsettled and the broker
// redelivers it with idem-attempt unchanged) on a quorum queue: after
// MaxDeliveries deliveries the next one is dead-lettered with reason
// redelivery_limit without running the handler, and the worker goes on.
func TestConsumerQuorumRedeliveryLimit(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueueArgs(t, url, consTestDelays, amqp091.Table{"x-queue-type": "quorum"})
	const maxDeliveries = 3
	var poisonRuns, goodRuns atomic.Int32
	h := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		if !strings.HasPrefix(msg.ID, "poison-") {
			goodRuns.Add(1)
			return nil
		}
		poisonRuns.Add(1)
		d, ok := DeliveryFrom(ctx)
		if !ok {
			return errors.New("no delivery in the context")
		}
		return consChannel(d).Close()
	})
	var limited atomic.Int32
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{
		QuorumQueue: true, MaxDeliveries: maxDeliveries, Prefetch: 1,
		Telemetry: consumer.Telemetry{
			OnOutcome: func(_ context.Context, r consumer.Report) {
				if r.Result.Reason == ReasonRedeliveryLimit && r.Result.Action == consumer.ActionDeadLetter {
					limited.Add(1)
				}
			},
		},
	}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	start := time.Now()
	consPublish(t, url, q, consMsgs("poison", 1)...)
	testenv.Eventually(t, 60*time.Second, "the poison message to be dead-lettered", func() bool { return c.Stats().DeadLettered >= 1 })
	t.Logf("poison dead-lettered after %v, %d handler runs", time.Since(start).Round(time.Millisecond), poisonRuns.Load())
	consPublish(t, url, q, consMsgs("good", 5)...)
	testenv.Eventually(t, 30*time.Second, "the worker to go on", func() bool { return c.Stats().Acked >= 5 })
	stop()
	st := c.Stats()
	t.Logf("stats: %+v", st)
	if n := poisonRuns.Load(); n != maxDeliveries {
		t.Errorf("the poison handler ran %d times, want MaxDeliveries = %d", n, maxDeliveries)
	}
	if n := goodRuns.Load(); n != 5 {
		t.Errorf("the good handler ran %d times, want 5", n)
	}
	if n := limited.Load(); n != 1 {
		t.Errorf("OnOutcome saw %d redelivery_limit dead letters, want 1", n)
	}
	if st.DeadLettered != 1 || st.Abandoned != maxDeliveries || st.Connects < maxDeliveries+1 {
		t.Errorf("want 1 dead letter, %d abandoned deliveries, %d+ connects; stats %+v", maxDeliveries, maxDeliveries+1, st)
	}
	dead := consGetAll(t, url, q+".dlq")
	if len(dead) != 1 {
		t.Fatalf("%d messages in the dead-letter queue, want 1", len(dead))
	}
	d := dead[0]
	if d.MessageId != "poison-0" || d.Headers[consumer.HeaderReason] != string(ReasonRedeliveryLimit) {
		t.Errorf("dead letter %q with reason %v, want poison-0 with %s", d.MessageId, d.Headers[consumer.HeaderReason], ReasonRedeliveryLimit)
	}
	if _, ok := d.Headers[HeaderDeliveryCount]; ok {
		t.Errorf("the dead letter kept %s: %v", HeaderDeliveryCount, d.Headers)
	}
	t.Logf("dead letter: reason %v, error %q", d.Headers[consumer.HeaderReason], d.Headers[consumer.HeaderError])
	if n := consDepth(t, url, q); n != 0 {
		t.Errorf("%d messages left in the queue", n)
	}
}

// A message that kills its worker process every time (a panic without
// Recover) on a quorum queue, between neighbours: ok-c before it, ok-d and
// ok-e after it, all prefetched with it. The worker is restarted after each
// death. Only the poison message is dead-lettered (redelivery_limit); every
// neighbour is applied exactly once and acknowledged, ok-c included, whose
// effect may have committed before the first death left its ack unsent.
func TestConsumerQuorumCrashLoopSparesNeighbours(t *testing.T) {
	t.Parallel()
	for _, conc := range []int{1, 4} {
		t.Run(fmt.Sprintf("concurrency %d", conc), func(t *testing.T) {
			url := testenv.AMQPURL()
			q := consQueueArgs(t, url, consTestDelays, amqp091.Table{"x-queue-type": "quorum"})
			o := effectstest.New(t, 2)
			var msgs []amqp091.Publishing
			for _, id := range []string{"ok-c", "poison", "ok-d", "ok-e"} {
				msgs = append(msgs, amqp091.Publishing{MessageId: id, Body: []byte("body of " + id)})
			}
			consPublish(t, url, q, msgs...)
			// Settled: the neighbours applied, or more than the poison
			// dead-lettered (the outcome this test rejects).
			settled := func() bool {
				_, distinct := o.Counts(t)
				return consDepth(t, url, q) == 0 && consDepth(t, url, q+".dlq") >= 1 && (distinct == 3 || consDepth(t, url, q+".dlq") >= 2)
			}
			deaths, stops := 0, 0
			// After a graceful stop put deliveries back, the next worker
			// is stopped only once it settled as many: a ready count of
			// zero does not show deliveries it holds unacknowledged.
			putBack := 0
			for {
				var settledHere atomic.Int64 // deliveries this worker settled
				p, err := childproc.Start(consPoisonChildCommand(url, q, o.Schema, conc), 64<<10, func(line string) {
					if strings.HasPrefix(line, consSettledLine) {
						settledHere.Add(1)
					}
				})
				if err != nil {
					t.Fatal(err)
				}
				died := false
				testenv.Eventually(t, 60*time.Second, "the worker to die or the messages to be settled", func() bool {
					select {
					case <-p.Exited():
						died = true
						return true
					default:
						return settled() && settledHere.Load() >= int64(putBack)
					}
				})
				if !died {
					_ = p.Cmd.Process.Signal(syscall.SIGTERM)
					<-p.Exited()
					if err := p.Err(); err != nil {
						t.Fatalf("the last worker: %v%s", err, p.StderrTail())
					}
					// A graceful stop requeues the deliveries the
					// worker had prefetched but not started, and puts
					// back, uncounted, the returned ones waiting to
					// run alone: the next worker settles them. (A
					// ready count of zero does not show
					// unacknowledged deliveries.)
					if putBack = consDepth(t, url, q); putBack == 0 {
						break
					}
					if stops++; stops > 3 {
						t.Fatalf("messages still come back to the queue after %d graceful stops", stops)
					}
					continue
				}
				if !strings.Contains(p.Stderr(), "panic: poison message poison") {
					t.Fatalf("the worker died of something else: %v%s", p.ExitErr(), p.StderrTail())
				}
				// The dead worker may have settled some of the deliveries
				// put back before it; the next one is stopped once the
				// queue looks settled, as before any stop.
				putBack = 0
				deaths++
				if deaths > 2*consPoisonMaxDeliveries {
					t.Fatalf("the worker died %d times; MaxDeliveries is %d", deaths, consPoisonMaxDeliveries)
				}
			}
			dead := consGetAll(t, url, q+".dlq")
			var ids []string
			for _, d := range dead {
				ids = append(ids, fmt.Sprintf("%s (%v)", d.MessageId, d.Headers[consumer.HeaderReason]))
			}
			t.Logf("%d deaths; dead letters: %v", deaths, ids)
			if len(dead) != 1 || dead[0].MessageId != "poison" || dead[0].Headers[consumer.HeaderReason] != string(ReasonRedeliveryLimit) {
				t.Errorf("dead letters %v, want only poison (%s)", ids, ReasonRedeliveryLimit)
			}
			rows, distinct := o.Counts(t)
			if rows != 3 || distinct != 3 {
				t.Errorf("effects: %d rows for %d ids, want ok-c, ok-d and ok-e once each", rows, distinct)
			}
			if n := consDepth(t, url, q); n != 0 {
				t.Errorf("%d messages left in the queue", n)
			}
		})
	}
}

// A message that "kills" its worker while holding a dedup lease (the
// handler closes its channel and never returns, and the lease has no
// heartbeat, as a dead process's lease): its next delivery finds the key
// in flight and waits on a fresh copy. The copies carry the count of
// deaths (HeaderReturns), so the message still reaches MaxDeliveries and is
// dead-lettered, instead of starting from zero after each wait.
func TestConsumerQuorumRedeliveryLimitAcrossWaits(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueueArgs(t, url, consTestDelays, amqp091.Table{"x-queue-type": "quorum"})
	const maxDeliveries = 3
	mem, err := memstore.New(memstore.Options{Lease: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	dd, err := consumer.Dedup(mem, consumer.DedupOptions{Scope: "test/returns", ExtendEvery: -1})
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	var runs atomic.Int32
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
		runs.Add(1)
		d, ok := DeliveryFrom(ctx)
		if !ok {
			return errors.New("no delivery in the context")
		}
		_ = consChannel(d).Close()
		<-release // a dead worker's handler never returns
		return nil
	}), consumer.Recover(), dd)
	var waits atomic.Int32
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{
		QuorumQueue: true, MaxDeliveries: maxDeliveries, Prefetch: 1,
		Telemetry: consumer.Telemetry{
			OnOutcome: func(_ context.Context, r consumer.Report) {
				if r.Result.Reason == consumer.OutcomeInFlight {
					waits.Add(1)
				}
			},
		},
	}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unblock) // before stop, which waits for the handlers
	consPublish(t, url, q, consMsgs("poison", 1)...)
	testenv.Eventually(t, 30*time.Second, "the poison message to be dead-lettered", func() bool { return c.Stats().DeadLettered >= 1 })
	unblock()
	stop()
	t.Logf("%d handler runs, %d waits; stats %+v", runs.Load(), waits.Load(), c.Stats())
	if n := runs.Load(); n != maxDeliveries {
		t.Errorf("the handler ran %d times, want MaxDeliveries = %d", n, maxDeliveries)
	}
	if waits.Load() == 0 {
		t.Error("no delivery waited for the held key: the test did not test the waits")
	}
	dead := consGetAll(t, url, q+".dlq")
	if len(dead) != 1 || dead[0].Headers[consumer.HeaderReason] != string(ReasonRedeliveryLimit) {
		t.Fatalf("%d dead letters, want poison-0 with %s", len(dead), ReasonRedeliveryLimit)
	}
	if _, ok := dead[0].Headers[HeaderReturns]; ok {
		t.Errorf("the dead letter kept %s: %v", HeaderReturns, dead[0].Headers)
	}
}

// A message returned by crashes runs alone, and its neighbour, returned
// with it by the first crash, is put back meanwhile instead of waiting
// unacknowledged behind it: the later crashes do not count against the
// neighbour. A graceful stop while the crashing message runs alone leaves
// the neighbour in the queue, below MaxDeliveries; the next consumer runs
// it once and dead-letters nothing.
func TestConsumerQuorumNeighbourNotCountedByLaterCrashes(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueueArgs(t, url, consTestDelays, amqp091.Table{"x-queue-type": "quorum"})
	const maxDeliveries = 3
	var (
		holdRuns atomic.Int32
		runs     consRuns
		release  = make(chan struct{})
	)
	h := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		runs.add(msg.ID)
		if msg.ID != "hold" {
			return nil
		}
		if holdRuns.Add(1) < maxDeliveries {
			// A crash: the delivery and every other one not settled
			// go back unsettled, counted.
			d, ok := DeliveryFrom(ctx)
			if !ok {
				return errors.New("no delivery in the context")
			}
			return consChannel(d).Close()
		}
		<-release
		return nil
	})
	opts := consOpts(ConsumerOptions{
		QuorumQueue: true, MaxDeliveries: maxDeliveries, Concurrency: 1, Prefetch: 10, ShutdownTimeout: 30 * time.Second,
	})
	c, err := NewConsumer(url, q, h, opts)
	if err != nil {
		t.Fatal(err)
	}
	consPublish(t, url, q, amqp091.Publishing{MessageId: "hold", Body: []byte("hold")}, amqp091.Publishing{MessageId: "neighbour", Body: []byte("neighbour")})
	workersStopped := consWorkersStopped(t, c)
	stop := consStart(t, c)
	// hold's third delivery runs (two crashes before it).
	testenv.Eventually(t, 60*time.Second, "hold's third delivery to run", func() bool { return holdRuns.Load() == maxDeliveries })
	consStopThenRelease(stop, workersStopped, release)
	st := c.Stats()
	t.Logf("stats %+v; neighbour ran %d times", st, runs.get("neighbour"))
	if st.DeadLettered != 0 {
		t.Errorf("stats %+v: want nothing dead-lettered", st)
	}
	left := consGetAll(t, url, q)
	for _, d := range left {
		if n := consReturns(&d); n >= maxDeliveries {
			t.Errorf("%s left in the queue with %d returns counted, want fewer than MaxDeliveries (%d)", d.MessageId, n, maxDeliveries)
		}
	}
	// The next consumer settles what is left.
	consPublish(t, url, q, func() []amqp091.Publishing {
		var ps []amqp091.Publishing
		for _, d := range left {
			// The count read here is carried over as the Consumer
			// carries it on the copies it puts back.
			h := amqp091.Table{}
			for k, v := range d.Headers {
				h[k] = v
			}
			delete(h, HeaderDeliveryCount)
			h[HeaderReturns] = consReturns(&d)
			ps = append(ps, amqp091.Publishing{MessageId: d.MessageId, Body: d.Body, Headers: h})
		}
		return ps
	}()...)
	c2, err := NewConsumer(url, q, h, opts)
	if err != nil {
		t.Fatal(err)
	}
	stop2 := consStart(t, c2)
	testenv.Eventually(t, 60*time.Second, "the neighbour to run", func() bool { return runs.get("neighbour") >= 1 })
	stop2()
	if n := runs.get("neighbour"); n != 1 {
		t.Errorf("the neighbour ran %d times, want once", n)
	}
	if st := c2.Stats(); st.DeadLettered != 0 {
		t.Errorf("second consumer: stats %+v: want nothing dead-lettered", st)
	}
	if left := consGetAll(t, url, q); len(left) != 0 {
		t.Errorf("%d messages left in the queue (first %q)", len(left), left[0].MessageId)
	}
	if dead := consGetAll(t, url, q+".dlq"); len(dead) != 0 {
		t.Errorf("%d dead letters (first %q)", len(dead), dead[0].MessageId)
	}
}

// A returned delivery one return short of MaxDeliveries is in its claim,
// under consumer.Dedup with more deliveries in flight than handlers
// (InFlight > Concurrency), when a graceful stop comes. It runs alone, so
// it holds no handler seat that the stop could take away: it finishes and
// is acknowledged instead of being given back to reach the bound.
func TestConsumerQuorumStopDuringAloneClaim(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueueArgs(t, url, consTestDelays, amqp091.Table{"x-queue-type": "quorum"})
	const maxDeliveries = 3
	mem, err := memstore.New(memstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mem.Close() })
	store := &gatedClaims{LeaseStore: mem, entered: make(chan struct{}), release: make(chan struct{})}
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "stop-alone"})
	if err != nil {
		t.Fatal(err)
	}
	var runs consRuns
	h := consumer.Chain(consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		runs.add(msg.ID)
		return nil
	}), dd)
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{
		QuorumQueue: true, MaxDeliveries: maxDeliveries, Concurrency: 1, InFlight: 2, Prefetch: 10,
		ShutdownTimeout: 30 * time.Second,
	}))
	if err != nil {
		t.Fatal(err)
	}
	// Returned twice already: the count a copy that waited for a held key
	// carries over.
	consPublish(t, url, q, amqp091.Publishing{MessageId: "neighbour", Body: []byte("neighbour"),
		Headers: amqp091.Table{HeaderReturns: int32(maxDeliveries - 1)}})
	workersStopped := consWorkersStopped(t, c)
	stop := consStart(t, c)
	select {
	case <-store.entered:
	case <-time.After(60 * time.Second):
		t.Fatal("the delivery's claim did not start within a minute")
	}
	consStopThenRelease(stop, workersStopped, store.release)
	st := c.Stats()
	t.Logf("stats %+v", st)
	if n := runs.get("neighbour"); n != 1 {
		t.Errorf("the handler ran %d times, want once", n)
	}
	if st.Requeued != 0 || st.DeadLettered != 0 || st.Acked != 1 {
		t.Errorf("stats %+v: want 1 acked, nothing requeued or dead-lettered", st)
	}
	if left := consGetAll(t, url, q); len(left) != 0 {
		t.Errorf("%d messages left in the queue (first %q)", len(left), left[0].MessageId)
	}
}

// gatedClaims is a lease store whose first claim waits for release, once
// it has closed entered.
type gatedClaims struct {
	dedup.LeaseStore
	once             sync.Once
	entered, release chan struct{}
}

func (g *gatedClaims) Claim(ctx context.Context, k dedup.Key) (*dedup.Lease, error) {
	g.once.Do(func() {
		close(g.entered)
		<-g.release
	})
	return g.LeaseStore.Claim(ctx, k)
}

// Several worker processes on one quorum queue, several messages that kill
// the worker process every time they run (a panic without Recover), and
// ordinary messages around them, prefetched with them: the deaths return
// the crash messages' neighbours unsettled, counted in x-delivery-count
// like the crash messages themselves. Dead workers are restarted at once.
// Every seed places the crash messages elsewhere; each one must end with
// the crash messages dead-lettered once each with reason redelivery_limit,
// no ordinary message dead-lettered, and every ordinary message applied
// exactly once (the pgtable oracle: none lost, none twice).
func TestConsumerQuorumCrashLoopSeveralWorkers(t *testing.T) {
	t.Parallel()
	const (
		seeds         = 10
		workers       = 3
		ordinary      = 300
		crashes       = 3
		maxDeliveries = 5
	)
	url := testenv.AMQPURL()
	consRequireBroker(t, url)
	var (
		mu                                              sync.Mutex
		innocentDead, crashDead, lost, twice, deathsAll int
	)
	// The seeds run side by side, each on its own queue and oracle schema;
	// the group ends when every seed has.
	t.Run("seeds", func(t *testing.T) {
		for seed := range seeds {
			t.Run(fmt.Sprintf("seed %d", seed), func(t *testing.T) {
				t.Parallel()
				q := consQueueArgs(t, url, consTestDelays, amqp091.Table{"x-queue-type": "quorum"})
				o := effectstest.New(t, 2)
				// Declared as the workers declare it, so that it can be
				// watched before the first one started.
				consAdmin(t, url, func(ch *amqp091.Channel) error {
					_, err := ch.QueueDeclare(q+".dlq", true, false, false, false, nil)
					return err
				})
				rng := rand.New(rand.NewPCG(uint64(seed), 0x1de))
				msgs := make([]amqp091.Publishing, 0, ordinary+crashes)
				for i := range ordinary {
					id := fmt.Sprintf("ok-%d", i)
					msgs = append(msgs, amqp091.Publishing{MessageId: id, Body: []byte("body of " + id)})
				}
				for i := range crashes {
					id := fmt.Sprintf("poison-%d", i)
					at := rng.IntN(len(msgs) + 1)
					msgs = slices.Insert(msgs, at, amqp091.Publishing{MessageId: id, Body: []byte("body of " + id)})
				}
				consPublish(t, url, q, msgs...)
				start := func() *childproc.Proc {
					cmd := consPoisonChildCommand(url, q, o.Schema, 4)
					cmd.Env = append(cmd.Env, consChildMaxEnv+"="+strconv.Itoa(maxDeliveries))
					p, err := childproc.Start(cmd, 64<<10, nil)
					if err != nil {
						t.Fatal(err)
					}
					return p
				}
				procs := make([]*childproc.Proc, workers)
				for i := range procs {
					procs[i] = start()
				}
				defer func() {
					for _, p := range procs {
						p.Kill()
						<-p.Exited()
					}
				}()
				deaths := 0
				// Settled: nothing ready in the work queue, and every message
				// applied or dead-lettered (or more dead-lettered than the
				// crash messages: the outcome this test rejects).
				settled := func() bool {
					_, distinct := o.Counts(t)
					dead := consDepth(t, url, q+".dlq")
					return consDepth(t, url, q) == 0 && dead >= crashes && distinct+dead >= ordinary+crashes
				}
				deadline := time.Now().Add(3 * time.Minute)
				for stops := 0; ; stops++ {
					for !settled() {
						if time.Now().After(deadline) {
							rows, distinct := o.Counts(t)
							t.Fatalf("not settled in 3 minutes: %d deaths, %d effect rows for %d ids, %d ready, %d dead letters",
								deaths, rows, distinct, consDepth(t, url, q), consDepth(t, url, q+".dlq"))
						}
						for i, p := range procs {
							select {
							case <-p.Exited():
							default:
								continue
							}
							if !strings.Contains(p.Stderr(), "panic: poison message poison-") {
								t.Fatalf("a worker died of something else: %v%s", p.ExitErr(), p.StderrTail())
							}
							deaths++
							if deaths > 2*crashes*maxDeliveries+workers {
								t.Fatalf("%d worker deaths for %d crash messages (MaxDeliveries %d)", deaths, crashes, maxDeliveries)
							}
							procs[i] = start()
						}
						time.Sleep(50 * time.Millisecond)
					}
					// Stop the workers gracefully, so that they send the acks
					// they hold. One that had just been started may die of
					// the signal before it handles it: then what it held
					// comes back, and the workers run again.
					for _, p := range procs {
						_ = p.Cmd.Process.Signal(syscall.SIGTERM)
					}
					for _, p := range procs {
						<-p.Exited()
						if err := p.Err(); err != nil && !consDiedOf(p, syscall.SIGTERM) && !strings.Contains(p.Stderr(), "panic: poison message poison-") {
							t.Fatalf("a worker's graceful stop: %v%s", err, p.StderrTail())
						}
					}
					if consDepth(t, url, q) == 0 {
						break
					}
					if stops >= 3 {
						t.Fatalf("messages still come back to the queue after %d graceful stops", stops+1)
					}
					for i := range procs {
						procs[i] = start()
					}
				}
				dead := consGetAll(t, url, q+".dlq")
				perCrash := map[string]int{}
				var wrong []string
				for _, d := range dead {
					if strings.HasPrefix(d.MessageId, "poison-") && d.Headers[consumer.HeaderReason] == string(ReasonRedeliveryLimit) {
						perCrash[d.MessageId]++
						continue
					}
					wrong = append(wrong, fmt.Sprintf("%s (%v, %v deliveries)", d.MessageId, d.Headers[consumer.HeaderReason], d.Headers[consumer.HeaderError]))
				}
				rows, distinct := o.Counts(t)
				mu.Lock()
				deathsAll += deaths
				innocentDead += len(wrong)
				lost += ordinary - distinct
				twice += rows - distinct
				for i := range crashes {
					crashDead += min(perCrash[fmt.Sprintf("poison-%d", i)], 1)
				}
				mu.Unlock()
				for i := range crashes {
					id := fmt.Sprintf("poison-%d", i)
					if n := perCrash[id]; n != 1 {
						t.Errorf("%s dead-lettered %d times, want once", id, n)
					}
				}
				if len(wrong) > 0 {
					t.Errorf("%d other dead letters: %v", len(wrong), wrong)
				}
				if rows != ordinary || distinct != ordinary {
					t.Errorf("effects: %d rows for %d ids, want %d once each", rows, distinct, ordinary)
				}
				if n := consDepth(t, url, q); n != 0 {
					t.Errorf("%d messages left in the queue", n)
				}
				t.Logf("seed %d: %d deaths, %d dead letters (%d ordinary), %d effect rows for %d ids", seed, deaths, len(dead), len(wrong), rows, distinct)
			})
		}
	})
	t.Logf("%d seeds, %d workers, %d ordinary and %d crash messages each: %d deaths, %d ordinary messages dead-lettered, %d of %d crash messages dead-lettered, %d lost, %d applied twice",
		seeds, workers, ordinary, crashes, deathsAll, innocentDead, crashDead, seeds*crashes, lost, twice)
}

// consDiedOf reports whether the exited child p died of the signal sig.
func consDiedOf(p *childproc.Proc, sig syscall.Signal) bool {
	var ee *exec.ExitError
	if errors.As(p.Err(), &ee) {
		ws, ok := ee.Sys().(syscall.WaitStatus)
		return ok && ws.Signaled() && ws.Signal() == sig
	}
	return false
}
