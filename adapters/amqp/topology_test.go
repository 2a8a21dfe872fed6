package idemamqp

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// topoRetryQueue says how a test declares the retry queue of delay d
// (the i-th): durable or not, and with which arguments.
type topoRetryQueue func(i int, d time.Duration) (durable bool, args amqp091.Table)

// topoDeclare declares, as an operator would for a Consumer with
// NoDeclare, the retry queues of q (each as rq says), the dead-letter
// exchange "<q>.dlx" and the queue "<q>.dlq", bound to it with q as
// routing key when bind is set. consQueue deletes them all when the test
// ends.
func topoDeclare(t *testing.T, url, q string, rq topoRetryQueue, bind bool) {
	t.Helper()
	consAdmin(t, url, func(ch *amqp091.Channel) error {
		for i, d := range consTestDelays {
			durable, args := rq(i, d)
			if _, err := ch.QueueDeclare(consRetryQueue(q, d), durable, false, false, false, args); err != nil {
				return err
			}
		}
		if err := ch.ExchangeDeclare(q+".dlx", amqp091.ExchangeDirect, true, false, false, false, nil); err != nil {
			return err
		}
		if _, err := ch.QueueDeclare(q+".dlq", true, false, false, false, nil); err != nil {
			return err
		}
		if !bind {
			return nil
		}
		return ch.QueueBind(q+".dlq", q, q+".dlx", false, nil)
	})
}

// topoRun runs a NoDeclare Consumer of q until it consumes (nil) or Run
// returns (its error).
func topoRun(t *testing.T, url, q string) error {
	t.Helper()
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{NoDeclare: true}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Logf("Run: %v", err)
		}
	}()
	select {
	case <-c.Ready():
		return nil
	case err := <-done:
		done <- nil
		return err
	case <-time.After(30 * time.Second):
		t.Fatal("Run neither consumed nor returned in 30s")
		return nil
	}
}

// A retry queue without the arguments that bring its expired copies back
// to the work queue drops every retried message: with NoDeclare, Run
// refuses such a topology, naming the queue and the argument, and accepts
// the retry queues whatever else they carry (durability, a queue type, a
// TTL, a length limit).
func TestTopologyNoDeclareRetryQueueArgs(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	dlx := func(q string) amqp091.Table {
		return amqp091.Table{argDeadLetterExchange: "", argDeadLetterRoutingKey: q}
	}
	for _, tc := range []struct {
		name string
		rq   func(q string) topoRetryQueue
		want []string // in the error; none: accepted
	}{
		{"no arguments", func(string) topoRetryQueue {
			return func(int, time.Duration) (bool, amqp091.Table) { return true, nil }
		}, []string{argDeadLetterExchange}},
		{"no routing key", func(string) topoRetryQueue {
			return func(int, time.Duration) (bool, amqp091.Table) {
				return true, amqp091.Table{argDeadLetterExchange: ""}
			}
		}, []string{argDeadLetterRoutingKey}},
		{"another routing key", func(q string) topoRetryQueue {
			return func(int, time.Duration) (bool, amqp091.Table) {
				return true, amqp091.Table{argDeadLetterExchange: "", argDeadLetterRoutingKey: q + ".other"}
			}
		}, []string{argDeadLetterRoutingKey}},
		{"another exchange", func(q string) topoRetryQueue {
			return func(int, time.Duration) (bool, amqp091.Table) {
				return true, amqp091.Table{argDeadLetterExchange: "amq.direct", argDeadLetterRoutingKey: q}
			}
		}, []string{argDeadLetterExchange}},
		{"the last one without arguments, behind a TTL", func(q string) topoRetryQueue {
			return func(i int, d time.Duration) (bool, amqp091.Table) {
				if i == len(consTestDelays)-1 {
					return true, amqp091.Table{argMessageTTL: d.Milliseconds()}
				}
				return true, dlx(q)
			}
		}, []string{argDeadLetterExchange}},
		{"accepted: durable, transient, quorum, TTL and limits", func(q string) topoRetryQueue {
			return func(i int, d time.Duration) (bool, amqp091.Table) {
				args := dlx(q)
				switch i {
				case 0:
					args[argMessageTTL] = int32(d.Milliseconds())
					args["x-max-length"] = int64(1000)
					args["x-overflow"] = "reject-publish"
					return false, args
				case 1:
					args[consQueueTypeArg] = "quorum"
				}
				return true, args
			}
		}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := consQueue(t, url, consTestDelays)
			topoDeclare(t, url, q, tc.rq(q), true)
			err := topoRun(t, url, q)
			if tc.want == nil {
				if err != nil {
					t.Fatalf("Run refused a topology that works: %v", err)
				}
				return
			}
			if !errors.Is(err, ErrTopologyMissing) {
				t.Fatalf("Run returned %v; want ErrTopologyMissing", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Run's error does not name %s: %v", w, err)
				}
			}
			t.Logf("Run: %v", err)
		})
	}
}

// A refused retry queue is left as it was: the check declares nothing.
func TestTopologyNoDeclareChecksWithoutChanging(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	topoDeclare(t, url, q, func(int, time.Duration) (bool, amqp091.Table) { return true, nil }, true)
	for range 2 {
		if err := topoRun(t, url, q); !errors.Is(err, ErrTopologyMissing) {
			t.Fatalf("Run returned %v; want ErrTopologyMissing", err)
		}
	}
	// Declared again as it was: still without arguments.
	consAdmin(t, url, func(ch *amqp091.Channel) error {
		for _, d := range consTestDelays {
			if _, err := ch.QueueDeclare(consRetryQueue(q, d), true, false, false, false, nil); err != nil {
				return err
			}
		}
		return nil
	})
}

// topoRunUntil runs a NoDeclare Consumer of q whose handler fails
// permanently for message "bad" and transiently for "flaky" (its first
// attempt), publishes msgs once it consumes, and returns Run's error, which
// must come within 30s, and the Consumer.
func topoRunUntil(t *testing.T, url, q string, msgs ...amqp091.Publishing) (*Consumer, error) {
	t.Helper()
	flaky := 0
	h := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		switch msg.ID {
		case "bad":
			return consumer.Permanent(errors.New("cannot parse the payload"))
		case "flaky":
			if flaky++; flaky == 1 {
				return errors.New("downstream unavailable")
			}
		}
		return nil
	})
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{NoDeclare: true}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	select {
	case <-c.Ready():
	case err := <-done:
		t.Fatalf("Run refused the topology at start: %v", err)
	}
	consPublish(t, url, q, msgs...)
	select {
	case err := <-done:
		return c, err
	case <-time.After(30 * time.Second):
		cancel()
		t.Logf("Run: %v", <-done)
		t.Fatalf("Run went on for 30s with a copy no queue takes; stats %+v", c.Stats())
		return c, nil
	}
}

// A dead-letter exchange that routes the work queue's name to no queue
// drops every dead letter (the broker confirms an unroutable message). AMQP
// 0-9-1 cannot list an exchange's bindings, and a probe routed through it
// would reach the dead-letter queue's readers; so the Consumer publishes its
// copies mandatory: the first dead letter the broker returns makes Run
// return an error naming the exchange and the routing key, and the message
// stays in the work queue.
func TestTopologyNoDeclareDeadLetterExchangeRoutesNowhere(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	topoDeclare(t, url, q, func(int, time.Duration) (bool, amqp091.Table) {
		return true, amqp091.Table{argDeadLetterExchange: "", argDeadLetterRoutingKey: q}
	}, false)
	c, err := topoRunUntil(t, url, q, amqp091.Publishing{MessageId: "bad", Body: []byte("b")})
	if !errors.Is(err, ErrTopologyMissing) || !strings.Contains(err.Error(), q+".dlx") || !strings.Contains(err.Error(), "routing key") {
		t.Fatalf("Run returned %v; want ErrTopologyMissing naming the dead-letter exchange and the routing key", err)
	}
	t.Logf("Run: %v", err)
	if st := c.Stats(); st.DeadLettered != 0 {
		t.Errorf("stats %+v: a dead letter no queue took counted as dead-lettered", st)
	}
	if got := consGetAll(t, url, q); len(got) != 1 || got[0].MessageId != "bad" {
		t.Errorf("work queue holds %d messages, want the message that could not be dead-lettered", len(got))
	}
}

// A retry queue deleted under a running NoDeclare Consumer: the retried copy
// the broker returns makes Run return an error naming the queue, and the
// message stays in the work queue.
func TestTopologyNoDeclareRetryQueueDeleted(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	topoDeclare(t, url, q, func(int, time.Duration) (bool, amqp091.Table) {
		return true, amqp091.Table{argDeadLetterExchange: "", argDeadLetterRoutingKey: q}
	}, true)
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return errors.New("downstream unavailable") })
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{NoDeclare: true}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	select {
	case <-c.Ready():
	case err := <-done:
		t.Fatalf("Run refused the topology at start: %v", err)
	}
	first := consRetryQueue(q, consTestDelays[0])
	consAdmin(t, url, func(ch *amqp091.Channel) error { _, err := ch.QueueDelete(first, false, false, false); return err })
	consPublish(t, url, q, amqp091.Publishing{MessageId: "flaky", Body: []byte("f")})
	select {
	case err = <-done:
	case <-time.After(30 * time.Second):
		cancel()
		t.Logf("Run: %v", <-done)
		t.Fatalf("Run went on for 30s without its retry queue; stats %+v", c.Stats())
	}
	if !errors.Is(err, ErrTopologyMissing) || !strings.Contains(err.Error(), first) {
		t.Fatalf("Run returned %v; want ErrTopologyMissing naming %s", err, first)
	}
	if st := c.Stats(); st.Retried != 0 {
		t.Errorf("stats %+v: a copy no queue took counted as retried", st)
	}
	if got := consGetAll(t, url, q); len(got) != 1 || got[0].MessageId != "flaky" {
		t.Errorf("work queue holds %d messages, want the message that could not be retried", len(got))
	}
}

// A Consumer that declares its topology finds it again when it was taken
// apart under it. First a retry queue is deleted: the retry copy the broker
// returns gives up the session, the reconnect declares the topology again,
// and the redelivered message is retried through the queue declared anew.
// Then the dead-letter queue is unbound: the dead-letter copy comes back,
// the session ends again, and the redelivered message is dead-lettered
// once. No copy is lost and none counts twice.
func TestTopologyDeclaredAgainAfterUnroutableCopy(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	var flakyRuns atomic.Int32
	h := consumer.Chain(consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		if msg.ID == "bad" {
			return consumer.Permanent(errors.New("cannot parse the payload"))
		}
		if flakyRuns.Add(1) <= 2 {
			return errors.New("downstream unavailable")
		}
		return nil
	}), consumer.Recover(), consMemDedup(t, "test/topology-again"))
	c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{}))
	if err != nil {
		t.Fatal(err)
	}
	stop := consStart(t, c)

	consAdmin(t, url, func(ch *amqp091.Channel) error {
		_, err := ch.QueueDelete(consRetryQueue(q, consTestDelays[0]), false, false, false)
		return err
	})
	consPublish(t, url, q, amqp091.Publishing{MessageId: "flaky", Body: []byte("f")})
	testenv.Eventually(t, 30*time.Second, "flaky retried once and acknowledged", func() bool {
		st := c.Stats()
		return st.Retried == 1 && st.Acked == 1
	})
	if st := c.Stats(); st.Connects < 2 || st.Retried != 1 || flakyRuns.Load() != 3 {
		t.Errorf("stats %+v after %d runs of flaky: want a reconnect after the returned retry copy, "+
			"one retry counted and three runs", st, flakyRuns.Load())
	}

	consAdmin(t, url, func(ch *amqp091.Channel) error { return ch.QueueUnbind(q+".dlq", q, q+".dlx", nil) })
	consPublish(t, url, q, amqp091.Publishing{MessageId: "bad", Body: []byte("b")})
	testenv.Eventually(t, 30*time.Second, "bad dead-lettered", func() bool { return c.Stats().DeadLettered >= 1 })
	stop()
	if st := c.Stats(); st.Connects < 3 || st.DeadLettered != 1 || st.Acked != 1 {
		t.Errorf("stats %+v: want a second reconnect after the returned dead-letter copy, one dead letter, one ack", st)
	}
	if dead := consGetAll(t, url, q+".dlq"); len(dead) != 1 || dead[0].MessageId != "bad" {
		t.Errorf("dead-letter queue holds %d messages, want bad once", len(dead))
	}
}

// topoExists reports whether the queue (or, with exchange set, the
// exchange) name exists.
func topoExists(t *testing.T, url, name string, exchange bool) bool {
	t.Helper()
	conn := consDial(t, url)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if exchange {
		err = ch.ExchangeDeclarePassive(name, amqp091.ExchangeDirect, false, false, false, false, nil)
	} else {
		_, err = ch.QueueDeclarePassive(name, false, false, false, false, nil)
	}
	var ae *amqp091.Error
	if errors.As(err, &ae) && ae.Code == amqp091.NotFound {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return true
}

// DeleteTopology deletes what a Consumer declared (its work, retry and
// dead-letter queues and its dead-letter exchange, with their messages)
// and nothing else: not a neighbour's queues, not a retry queue of a delay
// it was not given, not the producer's exchange the work queue was bound
// to.
func TestTopologyDelete(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	consRequireBroker(t, url)
	q := testenv.Name("idemtest_topo")
	producer := q + ".events"
	neighbours := []string{q + "x", q + ".retry.999ms", q + ".dlq.archive"}
	opts := consOpts(ConsumerOptions{
		Backoff:  consumer.Backoff{Initial: 20 * time.Millisecond, Max: 40 * time.Millisecond},
		Bindings: []ConsumerBinding{{Exchange: producer, Key: "order.created"}},
	})
	var mine []string
	for _, d := range opts.retryDelays() {
		mine = append(mine, consRetryQueue(q, d))
	}
	mine = append(mine, q, q+".dlq")
	t.Cleanup(func() {
		consAdmin(t, url, func(ch *amqp091.Channel) error {
			for _, n := range append(neighbours, mine...) {
				_, _ = ch.QueueDelete(n, false, false, false)
			}
			_ = ch.ExchangeDelete(q+".dlx", false, false)
			return ch.ExchangeDelete(producer, false, false)
		})
	})
	consAdmin(t, url, func(ch *amqp091.Channel) error {
		for _, n := range neighbours {
			if _, err := ch.QueueDeclare(n, true, false, false, false, nil); err != nil {
				return err
			}
		}
		return ch.ExchangeDeclare(producer, amqp091.ExchangeTopic, true, false, false, false, nil)
	})
	c, err := NewConsumer(url, q, consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }), opts)
	if err != nil {
		t.Fatal(err)
	}
	consStart(t, c)() // declares the topology, then stops
	for _, n := range mine {
		if !topoExists(t, url, n, false) {
			t.Fatalf("the Consumer did not declare %s", n)
		}
	}
	// Messages in the work and dead-letter queues go with them.
	consPublish(t, url, q, consMsgs("left", 3)...)
	consPublish(t, url, q+".dlq", consMsgs("dead", 2)...)

	conn := consDial(t, url)
	if err := DeleteTopology(context.Background(), conn, q, opts); err != nil {
		t.Fatal(err)
	}
	for _, n := range mine {
		if topoExists(t, url, n, false) {
			t.Errorf("queue %s is left", n)
		}
	}
	if topoExists(t, url, q+".dlx", true) {
		t.Errorf("exchange %s is left", q+".dlx")
	}
	for _, n := range neighbours {
		if !topoExists(t, url, n, false) {
			t.Errorf("DeleteTopology deleted queue %s, which is not the Consumer's", n)
		}
	}
	if !topoExists(t, url, producer, true) {
		t.Errorf("DeleteTopology deleted the producer's exchange %s", producer)
	}
	if conn.IsClosed() {
		t.Error("DeleteTopology closed the caller's connection")
	}
	// Once more: nothing to delete is no error.
	if err := DeleteTopology(context.Background(), conn, q, opts); err != nil {
		t.Errorf("DeleteTopology of a deleted topology: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := DeleteTopology(ctx, conn, q, opts); !errors.Is(err, context.Canceled) {
		t.Errorf("DeleteTopology with a cancelled context returned %v", err)
	}
	if err := DeleteTopology(context.Background(), nil, q, opts); err == nil {
		t.Error("DeleteTopology accepted a nil connection")
	}
}

// docs/rabbitmq.md shows chargeWorker, the transactional worker, as
// ExampleNewConsumer_transactional compiles and runs it.
func TestExampleChargeWorkerInDocs(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../../docs/rabbitmq.md")
	if err != nil {
		t.Fatal(err)
	}
	example, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	fn := func(src, where string) string {
		start := strings.Index(src, "\n// chargeWorker ")
		if start < 0 {
			t.Fatalf("%s has no chargeWorker", where)
		}
		end := strings.Index(src[start:], "\n}\n")
		if end < 0 {
			t.Fatalf("%s: chargeWorker does not end", where)
		}
		return src[start : start+end+3]
	}
	if d, e := fn(string(doc), "docs/rabbitmq.md"), fn(string(example), "example_test.go"); d != e {
		t.Errorf("docs/rabbitmq.md's chargeWorker differs from example_test.go's:\n%s\nwant:\n%s", d, e)
	}
}
