package bench

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	wm "github.com/ThreeDotsLabs/watermill"
	wmamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// The peer: Watermill's forwarder (components/forwarder), the outbox
// Watermill users run. The business transaction publishes an enveloped
// message to a forwarder topic on watermill-sql (v4, PostgreSQL, the
// shared server); the forwarder, a router handler, reads that topic and
// publishes each message to the broker through watermill-amqp (v3:
// persistent, to the durable exchange, waiting for the publisher confirm)
// or watermill-kafka (v3: a sarama sync producer, acks from all). It is
// configured for throughput: the subscriber polls every 10 ms and reads
// peerBatch rows per query (SubscribeBatchSize; its docs set no limit),
// the AMQP publisher keeps a pool of channels.

// peerName names the peer in the tables.
const peerName = "Watermill forwarder (watermill-sql v4)"

// peerBatch is the forwarder subscriber's batch, the relays' batch.
const peerBatch = outboxBatch

// forwarderOutbox is one forwarder topic on watermill-sql.
type forwarderOutbox struct {
	topic  string // the forwarder topic
	schema wmsql.SchemaAdapter
	offs   wmsql.OffsetsAdapter
}

func newForwarderOutbox(e *env) (*forwarderOutbox, error) {
	f := &forwarderOutbox{topic: testenv.Name("fwd")}
	f.schema = wmsql.DefaultPostgreSQLSchema{
		GenerateMessagesTableName: func(topic string) string { return pgx.Identifier{e.schema, "watermill_" + topic}.Sanitize() },
		SubscribeBatchSize:        peerBatch,
	}
	f.offs = wmsql.DefaultPostgreSQLOffsetsAdapter{
		GenerateMessagesOffsetsTableName: func(topic string) string {
			return pgx.Identifier{e.schema, "watermill_offsets_" + topic}.Sanitize()
		},
	}
	sub, err := f.subscriber(e)
	if err != nil {
		return nil, err
	}
	defer func() { _ = sub.Close() }()
	return f, sub.SubscribeInitialize(f.topic)
}

func (f *forwarderOutbox) subscriber(e *env) (*wmsql.Subscriber, error) {
	return wmsql.NewSubscriber(wmsql.BeginnerFromPgx(e.pool), wmsql.SubscriberConfig{
		ConsumerGroup: "forwarder", SchemaAdapter: f.schema, OffsetsAdapter: f.offs,
		PollInterval: 10 * time.Millisecond, ResendInterval: 10 * time.Millisecond, RetryInterval: 10 * time.Millisecond,
	}, wm.NopLogger{})
}

// enqueue publishes msgs to dest through the forwarder, in tx.
func (f *forwarderOutbox) enqueue(tx pgx.Tx, dest string, msgs ...*message.Message) error {
	pub, err := wmsql.NewPublisher(wmsql.TxFromPgx(tx), wmsql.PublisherConfig{SchemaAdapter: f.schema}, wm.NopLogger{})
	if err != nil {
		return err
	}
	return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: f.topic}).Publish(dest, msgs...)
}

// run runs the forwarder publishing through out until ctx ends: its
// error arrives on errc, and stopped closes once it and its subscriber
// are closed.
func (f *forwarderOutbox) run(ctx context.Context, e *env, out message.Publisher) (running <-chan struct{}, errc <-chan error, stopped <-chan struct{}, err error) {
	sub, err := f.subscriber(e)
	if err != nil {
		return nil, nil, nil, err
	}
	fw, err := forwarder.NewForwarder(sub, out, wm.NopLogger{}, forwarder.Config{ForwarderTopic: f.topic, CloseTimeout: 10 * time.Second})
	if err != nil {
		_ = sub.Close()
		return nil, nil, nil, err
	}
	errc, stopped = runUntil(ctx, func(ctx context.Context) error {
		closed := make(chan struct{})
		go func() {
			defer close(closed)
			<-ctx.Done()
			_ = fw.Close()
		}()
		err := fw.Run(ctx)
		<-closed
		_ = sub.Close()
		return err
	})
	return fw.Running(), errc, stopped, nil
}

// peerPublisher is the forwarder's publisher to target.
func peerPublisher(e *env, target relayTarget) (message.Publisher, error) {
	if target.name == kafkaTarget.name {
		k, err := e.broker()
		if err != nil {
			return nil, err
		}
		cfg := wmkafka.DefaultSaramaSyncPublisherConfig()
		cfg.Producer.RequiredAcks = sarama.WaitForAll
		return wmkafka.NewPublisher(wmkafka.PublisherConfig{Brokers: []string{k.addr}, Marshaler: wmkafka.DefaultMarshaler{}, OverwriteSaramaConfig: cfg}, wm.NopLogger{})
	}
	return wmamqp.NewPublisher(wmamqp.Config{
		Connection: wmamqp.ConnectionConfig{AmqpURI: e.amqpURL},
		Marshaler:  wmamqp.DefaultMarshaler{},
		Exchange:   wmamqp.ExchangeConfig{GenerateName: func(topic string) string { return topic }, Type: "topic", Durable: true},
		Publish: wmamqp.PublishConfig{GenerateRoutingKey: func(string) string { return "forwarded" },
			ConfirmDelivery: true, ChannelPoolSize: 8},
		TopologyBuilder: &wmamqp.DefaultTopologyBuilder{},
	}, wm.NopLogger{})
}

// wmCounting counts the messages the forwarder's publisher confirmed, and
// stamps them when s is set.
type wmCounting struct {
	message.Publisher
	n     atomic.Int64
	first atomic.Int64 // UnixNano of the first Publish
	want  int64
	done  chan struct{}
	end   time.Time
	s     *stamps
}

func (c *wmCounting) Publish(topic string, msgs ...*message.Message) error {
	c.first.CompareAndSwap(0, time.Now().UnixNano())
	if err := c.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	now := time.Now()
	if c.s != nil {
		for _, m := range msgs {
			c.s.confirm(m.UUID, now)
		}
	}
	ok := int64(len(msgs))
	if total := c.n.Add(ok); c.want > 0 && total >= c.want && total-ok < c.want {
		c.end = now
		close(c.done)
	}
	return nil
}

// peerSide is the forwarder's side of a relay row: n messages enqueued
// (untimed), then timed from the forwarder's first publish to the last
// confirm.
func peerSide(e *env, target relayTarget, topic string) side {
	return func(ctx context.Context, warm bool) (float64, error) {
		n := warmed(e.size.deliveries, warm)
		f, err := newForwarderOutbox(e)
		if err != nil {
			return 0, err
		}
		for i := 0; i < n; i += 1000 {
			var msgs []*message.Message
			for j := i; j < min(i+1000, n); j++ {
				msgs = append(msgs, message.NewMessage(e.id("m"), payload))
			}
			if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return f.enqueue(tx, topic, msgs...) }); err != nil {
				return 0, err
			}
		}
		p, err := peerPublisher(e, target)
		if err != nil {
			return 0, err
		}
		defer func() { _ = p.Close() }()
		pub := &wmCounting{Publisher: p, want: int64(n), done: make(chan struct{})}
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		_, errc, stopped, err := f.run(ctx, e, pub)
		if err != nil {
			return 0, err
		}
		defer func() { cancel(); <-stopped }()
		select {
		case <-pub.done:
		case err := <-errc:
			return 0, fmt.Errorf("forwarder stopped: %w", err)
		case <-time.After(10 * time.Minute):
			return 0, fmt.Errorf("the forwarder published %d of %d in 10 minutes", pub.n.Load(), n)
		}
		rate := float64(n) / pub.end.Sub(time.Unix(0, pub.first.Load())).Seconds()
		cancel()
		if err := <-errc; err != nil && !errors.Is(err, context.Canceled) {
			return 0, err
		}
		return rate, nil
	}
}

// peerLatency runs the forwarder to target while the producers publish
// one message per transaction through it.
func peerLatency(ctx context.Context, e *env, target relayTarget, topic string, rate int, d time.Duration) (latencyStats, error) {
	f, err := newForwarderOutbox(e)
	if err != nil {
		return latencyStats{}, err
	}
	p, err := peerPublisher(e, target)
	if err != nil {
		return latencyStats{}, err
	}
	defer func() { _ = p.Close() }()
	s := newStamps()
	pub := &wmCounting{Publisher: p, s: s}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	running, errc, stopped, err := f.run(rctx, e, pub)
	if err != nil {
		return latencyStats{}, err
	}
	defer func() { cancel(); <-stopped }()
	select {
	case <-running:
	case err := <-errc:
		return latencyStats{}, fmt.Errorf("forwarder stopped: %w", err)
	}
	enqueue := func(ctx context.Context, _ int) (string, error) {
		m := message.NewMessage(e.id("m"), payload)
		return m.UUID, pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return f.enqueue(tx, topic, m) })
	}
	return timedRun(ctx, s, errc, enqueue, rate, d, "forwarder")
}
