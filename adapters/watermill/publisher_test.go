package idemwatermill_test

import (
	"context"
	"errors"
	"reflect"
	"testing"

	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/outbox"
)

func outboxBatch() []*outbox.Message {
	return []*outbox.Message{
		{ID: "01", Topic: "orders", Key: []byte("A"), Payload: []byte("a1"), Headers: map[string]string{"traceparent": "00-1"}},
		{ID: "02", Topic: "orders", Key: []byte("B"), Payload: []byte("b1")},
		{ID: "03", Topic: "payments", Key: []byte("A"), Payload: []byte("a2")},
		{ID: "04", Topic: "payments", Payload: []byte("x")},
		{ID: "05", Topic: "orders", Key: []byte("B"), Payload: []byte("b2")},
	}
}

// TestPublisher: each run of one topic is one Publish call; a message keeps
// its outbox id as UUID and in outbox.HeaderMessageID, its headers as
// metadata, its key in MetadataKey.
func TestPublisher(t *testing.T) {
	t.Parallel()
	rec := &recordingPublisher{}
	p := must(idemwatermill.NewPublisher(rec))
	if err := p.Publish(context.Background(), outboxBatch()); err != nil {
		t.Fatal(err)
	}
	topics, msgs := rec.published()
	if want := []string{"orders", "orders", "payments", "payments", "orders"}; !reflect.DeepEqual(topics, want) {
		t.Fatalf("topics %v, want %v", topics, want)
	}
	m := msgs[0]
	if m.UUID != "01" || string(m.Payload) != "a1" || m.Metadata.Get(outbox.HeaderMessageID) != "01" ||
		m.Metadata.Get("traceparent") != "00-1" || m.Metadata.Get(idemwatermill.MetadataKey) != "A" {
		t.Errorf("first message: uuid %s payload %s metadata %v", m.UUID, m.Payload, m.Metadata)
	}
	if _, ok := msgs[3].Metadata[idemwatermill.MetadataKey]; ok {
		t.Error("a message without a key got MetadataKey")
	}
}

// TestPublisherFailures: a failed topic fails its messages and the later
// messages of their keys; the rest is sent. When nothing was sent, the error
// is returned as is (no attempt counted by the relay).
func TestPublisherFailures(t *testing.T) {
	t.Parallel()
	down := errors.New("broker down")
	rec := &recordingPublisher{err: func(topic string) error {
		if topic == "orders" {
			return down
		}
		return nil
	}}
	p := must(idemwatermill.NewPublisher(rec))
	err := p.Publish(context.Background(), outboxBatch())
	var pe *outbox.PublishError
	if !errors.As(err, &pe) {
		t.Fatalf("err = %v, want *outbox.PublishError", err)
	}
	// 0, 1 and 4 are on the failed topic; 2 shares key A with 0.
	failed := map[int]bool{}
	for i := range pe.Failed {
		failed[i] = true
	}
	if want := map[int]bool{0: true, 1: true, 2: true, 4: true}; !reflect.DeepEqual(failed, want) {
		t.Errorf("failed %v, want %v", failed, want)
	}
	if !errors.Is(pe.Failed[0], down) {
		t.Errorf("failure of #0: %v", pe.Failed[0])
	}
	if _, msgs := rec.published(); len(msgs) != 1 || msgs[0].UUID != "04" {
		t.Errorf("sent %v, want only #3 (id 04)", msgs)
	}

	all := &recordingPublisher{err: func(string) error { return down }}
	err = must(idemwatermill.NewPublisher(all)).Publish(context.Background(), outboxBatch())
	if !errors.Is(err, down) || errors.As(err, &pe) {
		t.Errorf("everything failed: err = %v, want the broker's error for the whole batch", err)
	}
}

// TestPublisherStopped: a cancelled context sends nothing and says why.
func TestPublisherStopped(t *testing.T) {
	t.Parallel()
	rec := &recordingPublisher{}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := must(idemwatermill.NewPublisher(rec)).Publish(ctx, outboxBatch())
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v", err)
	}
	if _, msgs := rec.published(); len(msgs) != 0 {
		t.Fatalf("sent %d messages", len(msgs))
	}
}
