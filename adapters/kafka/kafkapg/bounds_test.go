package kafkapg_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/adapters/kafka/kafkapg"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/kafkatest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// stuckLoad is the PostgreSQL Offsets whose first LoadOffsets does not
// answer until its context ends: a database that stopped answering on the
// connection the load got.
type stuckLoad struct {
	*kafkapg.Offsets
	loads atomic.Int64
}

func (s *stuckLoad) LoadOffsets(ctx context.Context, group, topic string, partitions []int) (map[int]int64, error) {
	if s.loads.Add(1) == 1 {
		<-ctx.Done()
		return nil, fmt.Errorf("load offsets: %w", ctx.Err())
	}
	return s.Offsets.LoadOffsets(ctx, group, topic, partitions)
}

// TestStuckOffsetLoadIsRetried: a load of the stored positions that never
// answers, at the assignment of the only member of a settled group, is cut
// short and tried again, and the partitions are consumed.
func TestStuckOffsetLoadIsRetried(t *testing.T) {
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	offsets, err := kafkapg.NewOffsets(pool, kafkapg.OffsetsOptions{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := offsets.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	k := kafkatest.New(t)
	topic := k.Topic(t, "stuck", 2)
	dlq := topic + "_dlq"
	k.CreateTopic(t, dlq, 1)
	group := testenv.Name("g")
	var recs []kafkago.Message
	for i := range 20 {
		id := fmt.Sprintf("m-%02d", i)
		recs = append(recs, kafkago.Message{Partition: i % 2, Key: []byte(id), Value: []byte("v"),
			Headers: []kafkago.Header{{Key: outbox.HeaderMessageID, Value: []byte(id)}}})
	}
	w := &kafkago.Writer{
		Addr: kafkago.TCP(k.Brokers...), Topic: topic, Transport: k.Transport, RequiredAcks: kafkago.RequireAll,
		Balancer: kafkago.BalancerFunc(func(m kafkago.Message, _ ...int) int { return m.Partition }),
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	err = w.WriteMessages(wctx, recs...)
	cancel()
	if cerr := w.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}

	store := &stuckLoad{Offsets: offsets}
	var handled atomic.Int64
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		handled.Add(1)
		return nil
	})
	c, err := idemkafka.NewConsumer(kafkago.ReaderConfig{
		Brokers: k.Brokers, GroupID: group, Topic: topic,
		HeartbeatInterval: 100 * time.Millisecond, SessionTimeout: 10 * time.Second, RebalanceTimeout: 20 * time.Second,
		JoinGroupBackoff: 100 * time.Millisecond, MaxWait: 100 * time.Millisecond,
		ReadBackoffMin: 10 * time.Millisecond, ReadBackoffMax: 100 * time.Millisecond,
	}, h, idemkafka.ConsumerOptions{Offsets: store, DeadLetterTopic: dlq, CommitInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	errc := make(chan error, 1)
	go func() { errc <- c.Run(rctx) }()
	testenv.Eventually(t, 60*time.Second, "every record handled", func() bool { return handled.Load() == int64(len(recs)) })
	testenv.Eventually(t, 30*time.Second, "the positions at the end of the partitions", func() bool {
		got, err := offsets.LoadOffsets(ctx, group, topic, []int{0, 1})
		return err == nil && got[0] == 10 && got[1] == 10
	})
	stop()
	if err := <-errc; err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("Run: %v", err)
	}
	if n := store.loads.Load(); n < 2 {
		t.Errorf("%d loads; the stuck one was not tried again", n)
	}
}
