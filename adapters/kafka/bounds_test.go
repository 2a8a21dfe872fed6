package idemkafka_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestRunReturnsPastAHandlerThatIgnoresItsContext: a handler that keeps
// running after its context was cancelled does not hold Run (nor the
// member's next join) for as long as it runs; its record is not committed.
func TestRunReturnsPastAHandlerThatIgnoresItsContext(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "stuckhandler", 1)
	group := testenv.Name("g")
	k.produce(t, topic, rec(0, "k", "a", "v"), rec(0, "k", "b", "v"), rec(0, "k", "c", "v"))

	release := make(chan struct{})
	var (
		released atomic.Bool
		started  atomic.Bool
	)
	t.Cleanup(func() {
		if released.CompareAndSwap(false, true) {
			close(release)
		}
	})
	h := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		if msg.ID == "b" {
			started.Store(true)
			<-release // ignores its context
		}
		return nil
	})
	c, err := idemkafka.NewConsumer(k.readerConfig(group, topic), h, idemkafka.ConsumerOptions{
		DeadLetterTopic: k.dlq(t, topic),
		CommitInterval:  20 * time.Millisecond,
		ShutdownTimeout: 100 * time.Millisecond,
		Telemetry: consumer.Telemetry{
			Logger: testLogger(t),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	eventually(t, 30*time.Second, "the handler stuck on b", started.Load)
	eventually(t, 30*time.Second, "a committed", func() bool { return k.committed(t, group, topic, 1)[0] == 1 })
	cancel()
	var returned bool
	eventually(t, 30*time.Second, "Run returned", func() bool {
		select {
		case err := <-done:
			if err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("Run: %v", err)
			}
			returned = true
		default:
		}
		return returned
	})
	if got := k.committed(t, group, topic, 1)[0]; got != 1 {
		t.Fatalf("committed %d; b (offset 1) never finished", got)
	}
	if released.CompareAndSwap(false, true) {
		close(release)
	}
}
