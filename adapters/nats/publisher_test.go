package idemnats

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/effectstest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// crashAfterPublish is the relay's publisher for its first crashes
// batches: it publishes through the real Publisher, then reports a
// failure, as a relay that crashed between the publish and the mark
// would leave things: the messages are in the stream, the rows are not
// marked, and the relay publishes them again.
type crashAfterPublish struct {
	pub     *Publisher
	mu      sync.Mutex
	crashes int
}

func (c *crashAfterPublish) Publish(ctx context.Context, msgs []*outbox.Message) error {
	if err := c.pub.Publish(ctx, msgs); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.crashes > 0 {
		c.crashes--
		return errors.New("relay crashed after the publish, before the mark")
	}
	return nil
}

// The outbox relay publishes every message with its row id as
// Nats-Msg-Id. A relay that publishes a batch again after a crash between
// publish and mark stores nothing twice: JetStream's duplicate window
// drops the copies (PubAck.Duplicate), the stream holds each message
// once, and a Consumer applies each once.
func TestPublisherRelayRePublish(t *testing.T) {
	t.Parallel()
	_, js := testenv.NATS(t)
	s := newStream(t, js, 0)
	o := effectstest.New(t, 8)
	ctx := testenv.Ctx(t)
	ob, err := pgoutbox.New(o.Pool, pgoutbox.Options{Schema: o.Schema, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	const n = 60
	var ids []string
	for i := range n {
		err := pgx.BeginFunc(ctx, o.Pool, func(tx pgx.Tx) error {
			got, err := ob.Enqueue(ctx, tx, outbox.Message{Topic: s.subject(), Key: fmt.Appendf(nil, "k%d", i%7), Payload: fmt.Appendf(nil, "event %d", i)})
			ids = append(ids, got...)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	pub, err := NewPublisher(js, PublisherOptions{ExpectStream: s.name})
	if err != nil {
		t.Fatal(err)
	}
	relay, err := pgoutbox.NewRelay(ob, &crashAfterPublish{pub: pub, crashes: 3}, pgoutbox.RelayOptions{BatchSize: 10, PollInterval: 20 * time.Millisecond, Telemetry: consumer.Telemetry{Logger: quiet()}})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(rctx) }()
	testenv.Eventually(t, 60*time.Second, "every row published", func() bool {
		pending, _, err := ob.Backlog(ctx)
		return err == nil && pending == 0
	})
	stopRelay()
	if err := <-relayDone; err != nil {
		t.Fatal(err)
	}
	st := pub.Stats()
	if st.Duplicates == 0 {
		t.Fatal("no re-publish was answered as a duplicate")
	}
	if st.Published != n+st.Duplicates {
		t.Errorf("Published %d = %d messages + %d duplicates?", st.Published, n, st.Duplicates)
	}
	stream, err := js.Stream(ctx, s.name)
	if err != nil {
		t.Fatal(err)
	}
	msgs := readAll(t, stream)
	seen := map[string]int{}
	for _, m := range msgs {
		seen[m.Headers().Get(nats.MsgIdHdr)]++
	}
	if len(msgs) != n || len(seen) != n {
		t.Errorf("the stream holds %d messages with %d ids, want %d once each", len(msgs), len(seen), n)
	}
	for _, id := range ids {
		if seen[id] != 1 {
			t.Errorf("outbox row %s is in the stream %d times", id, seen[id])
		}
	}
	t.Logf("%d rows, %d re-published copies dropped by the duplicate window", n, st.Duplicates)

	c, err := NewConsumer(js, s.name, "work", o.Handler(t, nil), ConsumerOptions{Concurrency: 4, Telemetry: consumer.Telemetry{Logger: quiet()}})
	if err != nil {
		t.Fatal(err)
	}
	stop := runConsumer(t, c)
	testenv.Eventually(t, 30*time.Second, "every message applied", func() bool { _, d := o.Counts(t); return d == n })
	testenv.Eventually(t, 30*time.Second, "nothing pending", func() bool { return pending(t, js, s.name, "work") == 0 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	o.Check(t, ids)
}

// Publish fails the messages it cannot send by index, and a key's later
// messages after a failed one, and confirms the rest.
func TestPublisherFailures(t *testing.T) {
	t.Parallel()
	_, js := testenv.NATS(t)
	s := newStream(t, js, 0)
	pub, err := NewPublisher(js, PublisherOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := testenv.Ctx(t)
	msgs := []*outbox.Message{
		{ID: "a1", Topic: s.subject(), Key: []byte("a"), Payload: []byte("1")},
		{ID: "b1", Topic: s.name + ".unstored", Key: []byte("b"), Payload: []byte("1")},
		{ID: "b2", Topic: s.subject(), Key: []byte("b"), Payload: []byte("2")},
		{ID: "", Topic: s.subject(), Payload: []byte("no id")},
		{ID: "a2", Topic: s.subject(), Key: []byte("a"), Payload: []byte("2")},
		{ID: "n1", Topic: s.subject(), Payload: []byte("no key")},
	}
	err = pub.Publish(ctx, msgs)
	var pe *outbox.PublishError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish = %v, want a PublishError", err)
	}
	for i, want := range []bool{false, true, true, true, false, false} {
		if _, failed := pe.Failed[i]; failed != want {
			t.Errorf("message %d (%s): failed %v, want %v (%v)", i, msgs[i].ID, failed, want, pe.Failed[i])
		}
	}
	if !errors.Is(pe.Failed[2], errPredecessor) {
		t.Errorf("b2 failed with %v, want errPredecessor", pe.Failed[2])
	}
	stream, err := js.Stream(ctx, s.name)
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	for _, m := range readAll(t, stream) {
		order = append(order, m.Headers().Get(nats.MsgIdHdr))
	}
	if fmt.Sprint(order) != "[a1 n1 a2]" && fmt.Sprint(order) != "[n1 a1 a2]" && fmt.Sprint(order) != "[a1 a2 n1]" {
		t.Errorf("stream holds %v, want a1 before a2 and n1", order)
	}
	if _, err := NewPublisher(nil, PublisherOptions{}); err == nil {
		t.Error("NewPublisher accepted a nil JetStream")
	}
}
