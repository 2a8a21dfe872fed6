package idemkafka_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/outbox"
)

// A producer publishes through the outbox Publisher (the outbox id travels in
// a header) and re-publishes order-1, as a relay does after a crash; the
// Consumer charges each order once. The cluster is kfake, in process.
func Example() {
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "payments", "payments.dlq"))
	if err != nil {
		panic(err)
	}
	defer cluster.Close()
	brokers := cluster.ListenAddrs()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// Publish. The Writer has a Transport of its own, closed at the end.
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	w := &kafkago.Writer{
		Addr:         kafkago.TCP(brokers...),
		Topic:        "payments",
		RequiredAcks: kafkago.RequireAll,
		BatchTimeout: 10 * time.Millisecond,
		Transport:    transport,
	}
	defer w.Close()
	pub, err := idemkafka.NewPublisher(w, idemkafka.PublisherOptions{})
	if err != nil {
		panic(err)
	}
	err = pub.Publish(ctx, []*outbox.Message{
		{ID: "order-1", Key: []byte("alice"), Payload: []byte("10.00")},
		{ID: "order-2", Key: []byte("bob"), Payload: []byte("25.00")},
		{ID: "order-1", Key: []byte("alice"), Payload: []byte("10.00")}, // re-published
		{ID: "order-3", Key: []byte("alice"), Payload: []byte("7.50")},
	})
	if err != nil {
		panic(err)
	}

	// Consume: the dedup claim in front of the handler.
	store, err := memstore.New(memstore.Options{})
	if err != nil {
		panic(err)
	}
	defer store.Close()
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "billing/charge"})
	if err != nil {
		panic(err)
	}
	charge := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		fmt.Printf("charged %s: %s\n", msg.ID, msg.Payload)
		return nil
	})
	var seen atomic.Int64
	c, err := idemkafka.NewConsumer(kafkago.ReaderConfig{
		Brokers: brokers,
		GroupID: "billing",
		Topic:   "payments",
	}, consumer.Chain(charge, consumer.Recover(), dd), idemkafka.ConsumerOptions{
		DeadLetterTopic: "payments.dlq",
		Telemetry: consumer.Telemetry{
			OnOutcome: func(_ context.Context, rep consumer.Report) {
				msg, r := rep.Message, rep.Result
				if r.Duplicate {
					fmt.Printf("%s again: duplicate, acknowledged\n", msg.ID)
				}
				if seen.Add(1) == 4 {
					cancel() // stop: commit, leave the group
				}
			},
		},
	})
	if err != nil {
		panic(err)
	}
	if err := c.Run(ctx); err != nil {
		panic(err)
	}

	// Output:
	// charged order-1: 10.00
	// charged order-2: 25.00
	// order-1 again: duplicate, acknowledged
	// charged order-3: 7.50
}

// An application that keeps its own kafka-go loop (FetchMessage, then
// CommitMessages) puts idem in it with MessageFrom and consumer.Process: the
// offset is committed only when the Result says the record is done, and a
// record the handler asks to retry is run again in place.
func ExampleMessageFrom() {
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"))
	if err != nil {
		panic(err)
	}
	defer cluster.Close()
	brokers := cluster.ListenAddrs()
	ctx := context.Background()
	transport := &kafkago.Transport{}
	defer transport.CloseIdleConnections()
	w := &kafkago.Writer{Addr: kafkago.TCP(brokers...), Topic: "orders", RequiredAcks: kafkago.RequireAll, Transport: transport}
	defer w.Close()
	id := func(v string) []kafkago.Header {
		return []kafkago.Header{{Key: outbox.HeaderMessageID, Value: []byte(v)}}
	}
	err = w.WriteMessages(ctx,
		kafkago.Message{Value: []byte("10.00"), Headers: id("order-1")},
		kafkago.Message{Value: []byte("10.00"), Headers: id("order-1")}, // re-published
		kafkago.Message{Value: []byte("??")},                            // no id
		kafkago.Message{Value: []byte("7.50"), Headers: id("order-2")},
	)
	if err != nil {
		panic(err)
	}

	store, err := memstore.New(memstore.Options{})
	if err != nil {
		panic(err)
	}
	defer store.Close()
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "billing/charge"})
	if err != nil {
		panic(err)
	}
	h := consumer.Chain(consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		fmt.Printf("charged %s (partition %s, offset %s): %s\n", msg.ID,
			msg.Metadata[idemkafka.MetadataPartition], msg.Metadata[idemkafka.MetadataOffset], msg.Payload)
		return nil
	}), consumer.Recover(), dd)

	// The application's loop.
	r := kafkago.NewReader(kafkago.ReaderConfig{Brokers: brokers, GroupID: "billing", Topic: "orders", MaxWait: 100 * time.Millisecond})
	defer r.Close()
	for range 4 {
		km, err := r.FetchMessage(ctx)
		if err != nil {
			panic(err)
		}
		msg, err := idemkafka.MessageFrom(&km, idemkafka.MessageOptions{Group: "billing"})
		res := consumer.Result{Action: consumer.ActionDeadLetter, Reason: consumer.OutcomeInvalidKey, Err: err}
		for err == nil {
			if res = consumer.Process(ctx, h, msg); res.Action != consumer.ActionRetry {
				break
			}
			time.Sleep(100 * time.Millisecond) // transient: run it again
		}
		switch {
		case res.Duplicate:
			fmt.Printf("%s again: duplicate\n", msg.ID)
		case res.Action == consumer.ActionDeadLetter:
			// Publish the record to a dead-letter topic here.
			fmt.Printf("offset %d dead-lettered: %s\n", km.Offset, res.Reason)
		}
		// Done: its effect committed, a duplicate, or dead-lettered.
		if err := r.CommitMessages(ctx, km); err != nil {
			panic(err)
		}
	}

	// Output:
	// charged order-1 (partition 0, offset 0): 10.00
	// order-1 again: duplicate
	// offset 2 dead-lettered: invalid_key
	// charged order-2 (partition 0, offset 3): 7.50
}
