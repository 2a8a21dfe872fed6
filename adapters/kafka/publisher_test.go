package idemkafka_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/outbox"
)

func TestPublisherHeadersAndTopics(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "pub", 1)
	w := &kafkago.Writer{
		Addr:         kafkago.TCP(k.brokers...),
		RequiredAcks: kafkago.RequireAll,
		BatchTimeout: 5 * time.Millisecond,
		Transport:    k.tr,
	}
	defer w.Close()
	pub, err := idemkafka.NewPublisher(w, idemkafka.PublisherOptions{})
	if err != nil {
		t.Fatal(err)
	}
	err = pub.Publish(context.Background(), []*outbox.Message{
		{ID: "o-1", Topic: topic, Key: []byte("k1"), Payload: []byte("one"),
			Headers: map[string]string{"b": "2", "a": "1", outbox.HeaderMessageID: "forged"}},
		{ID: "", Topic: topic, Payload: []byte("no id")},
		{ID: "o-3", Payload: []byte("no topic")},
		{ID: "o-4", Topic: topic, Payload: []byte("four")},
	})
	var pe *outbox.PublishError
	if !errors.As(err, &pe) || len(pe.Failed) != 2 || pe.Failed[1] == nil || pe.Failed[2] == nil {
		t.Fatalf("Publish = %v; want a PublishError for #1 and #2", err)
	}
	got := k.readAll(t, topic, 1)
	if len(got) != 2 {
		t.Fatalf("%d records published, want 2", len(got))
	}
	m := got[0]
	var hs []string
	for _, h := range m.Headers {
		hs = append(hs, h.Key+"="+string(h.Value))
	}
	if want := "a=1 b=2 " + outbox.HeaderMessageID + "=o-1"; strings.Join(hs, " ") != want || string(m.Key) != "k1" || string(m.Value) != "one" {
		t.Fatalf("record: key %q value %q headers %v; want headers %s", m.Key, m.Value, hs, want)
	}
	if string(got[1].Value) != "four" {
		t.Fatalf("second record %q", got[1].Value)
	}

	// A writer bound to a topic refuses messages for another.
	w2 := &kafkago.Writer{Addr: kafkago.TCP(k.brokers...), Topic: topic, RequiredAcks: kafkago.RequireAll, BatchTimeout: 5 * time.Millisecond, Transport: k.tr}
	defer w2.Close()
	pub2, err := idemkafka.NewPublisher(w2, idemkafka.PublisherOptions{IDHeader: "x-id"})
	if err != nil {
		t.Fatal(err)
	}
	err = pub2.Publish(context.Background(), []*outbox.Message{
		{ID: "o-5", Topic: "elsewhere", Payload: []byte("x")},
		{ID: "o-6", Payload: []byte("six")},
	})
	if !errors.As(err, &pe) || len(pe.Failed) != 1 || pe.Failed[0] == nil {
		t.Fatalf("Publish = %v; want a PublishError for #0", err)
	}
	got = k.readAll(t, topic, 1)
	if last := got[len(got)-1]; string(last.Value) != "six" || last.Headers[0].Key != "x-id" || string(last.Headers[0].Value) != "o-6" {
		t.Fatalf("last record %q headers %v", last.Value, last.Headers)
	}
}

func TestNewPublisherChecksTheWriter(t *testing.T) {
	for name, w := range map[string]*kafkago.Writer{
		"nil":     nil,
		"async":   {Addr: kafkago.TCP("x"), Async: true, RequiredAcks: kafkago.RequireAll},
		"one ack": {Addr: kafkago.TCP("x"), RequiredAcks: kafkago.RequireOne},
		"no acks": {Addr: kafkago.TCP("x")},
		"no addr": {RequiredAcks: kafkago.RequireAll},
	} {
		if _, err := idemkafka.NewPublisher(w, idemkafka.PublisherOptions{}); err == nil {
			t.Errorf("%s: NewPublisher accepted the writer", name)
		}
	}
}

// TestPublisherPartialFailure: kafka-go's WriteErrors (one partition's batch
// refused) and a record too large become a PublishError naming exactly the
// records not confirmed.
func TestPublisherPartialFailure(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(2, "pp"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// Every produce request for partition 1 is refused.
	c.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		pr := req.(*kmsg.ProduceRequest)
		for _, tp := range pr.Topics {
			for _, p := range tp.Partitions {
				if p.Partition == 1 {
					c.KeepControl()
					resp := pr.ResponseKind().(*kmsg.ProduceResponse)
					rt := kmsg.NewProduceResponseTopic()
					rt.Topic = tp.Topic
					rp := kmsg.NewProduceResponseTopicPartition()
					rp.Partition = 1
					rp.ErrorCode = kerr.InvalidRecord.Code
					rt.Partitions = append(rt.Partitions, rp)
					resp.Topics = append(resp.Topics, rt)
					return resp, nil, true
				}
			}
		}
		c.KeepControl()
		return nil, nil, false
	})
	tr := &kafkago.Transport{}
	defer tr.CloseIdleConnections()
	w := &kafkago.Writer{
		Addr:         kafkago.TCP(c.ListenAddrs()...),
		Topic:        "pp",
		Balancer:     kafkago.BalancerFunc(func(m kafkago.Message, _ ...int) int { return int(m.Key[0] - '0') }),
		RequiredAcks: kafkago.RequireAll,
		BatchTimeout: 5 * time.Millisecond,
		BatchBytes:   1 << 10,
		MaxAttempts:  1,
		Transport:    tr,
	}
	defer w.Close()
	pub, err := idemkafka.NewPublisher(w, idemkafka.PublisherOptions{})
	if err != nil {
		t.Fatal(err)
	}
	err = pub.Publish(context.Background(), []*outbox.Message{
		{ID: "a", Key: []byte("0"), Payload: []byte("ok")},
		{ID: "b", Key: []byte("1"), Payload: []byte("refused")},
		{ID: "c", Key: []byte("0"), Payload: make([]byte, 4<<10)}, // too large
		{ID: "d", Key: []byte("0"), Payload: []byte("ok too")},
	})
	var pe *outbox.PublishError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish = %v; want a PublishError", err)
	}
	if len(pe.Failed) != 2 || pe.Failed[1] == nil || pe.Failed[2] == nil {
		t.Fatalf("failed %v; want #1 (refused) and #2 (too large)", pe.Failed)
	}
	if !errors.Is(pe.Failed[1], kafkago.InvalidRecord) {
		t.Errorf("#1: %v; want kafka-go's InvalidRecord", pe.Failed[1])
	}
}
