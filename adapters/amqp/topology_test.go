package idemamqp

import (
	"context"
	"errors"
	"strings"
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
		<-done
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
