package idemkafka_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemkit/idem/adapters/adaptertest"
	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/kafkatest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// TestConformance runs the adapter conformance suite on the Consumer:
// each destination is a topic of two partitions (keys hashed to them) on a
// kfake cluster of its own, or on the brokers of IDEM_TEST_KAFKA_BROKERS,
// consumed with four workers per partition, so records of one key are
// handled in order and records of other keys do not wait for them.
func TestConformance(t *testing.T) {
	adaptertest.Run(t, &kafkaHarness{clusters: map[string]*kfake.Cluster{}})
}

// kafkaHarness is the Kafka adapter's adaptertest.Harness.
type kafkaHarness struct {
	mu       sync.Mutex
	clusters map[string]*kfake.Cluster // by topic; none on real brokers
}

const conformancePartitions = 2

func (h *kafkaHarness) Capabilities() adaptertest.Capabilities {
	return adaptertest.Capabilities{Ordering: adaptertest.OrderPerKey, ChildProcess: true}
}

func (h *kafkaHarness) NewDestination(t testing.TB, _ adaptertest.ConsumerOptions) adaptertest.Destination {
	t.Helper()
	var (
		brokers []string
		cluster *kfake.Cluster
	)
	if os.Getenv(kafkatest.BrokersEnv) != "" {
		brokers = kafkatest.New(t).Brokers
	} else {
		c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(100*time.Millisecond))
		if err != nil {
			t.Fatalf("kfake: %v", err)
		}
		t.Cleanup(c.Close)
		cluster, brokers = c, c.ListenAddrs()
	}
	env := &kafkatest.Env{Brokers: brokers, Transport: &kafkago.Transport{}}
	t.Cleanup(env.Transport.CloseIdleConnections)
	env.Client = &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: env.Transport, Timeout: 10 * time.Second}
	topic := env.Topic(t, "conformance", conformancePartitions)
	env.CreateTopic(t, topic+"_dlq", 1)
	if cluster != nil {
		h.mu.Lock()
		h.clusters[topic] = cluster
		h.mu.Unlock()
	}
	return adaptertest.Destination{Name: topic, DeadLetter: topic + "_dlq", Params: map[string]string{
		"brokers": strings.Join(brokers, ","),
		"group":   testenv.Name("g"),
	}}
}

func brokersOf(d adaptertest.Destination) []string { return strings.Split(d.Params["brokers"], ",") }

func (h *kafkaHarness) Publish(ctx context.Context, d adaptertest.Destination, msgs ...adaptertest.Message) error {
	tr := &kafkago.Transport{}
	defer tr.CloseIdleConnections()
	w := &kafkago.Writer{
		Addr:         kafkago.TCP(brokersOf(d)...),
		Topic:        d.Name,
		Balancer:     &kafkago.Hash{},
		RequiredAcks: kafkago.RequireAll,
		BatchTimeout: time.Millisecond,
		Transport:    tr,
	}
	defer func() { _ = w.Close() }()
	recs := make([]kafkago.Message, len(msgs))
	for i, m := range msgs {
		recs[i] = kafkago.Message{Key: m.Key, Value: m.Payload}
		for k, v := range m.Headers {
			recs[i].Headers = append(recs[i].Headers, kafkago.Header{Key: k, Value: []byte(v)})
		}
		if m.ID != "" {
			recs[i].Headers = append(recs[i].Headers, kafkago.Header{Key: outbox.HeaderMessageID, Value: []byte(m.ID)})
		}
	}
	// One write per record keeps the records of a key in order across
	// the Writer's batches.
	for _, r := range recs {
		if err := w.WriteMessages(ctx, r); err != nil {
			return err
		}
	}
	return nil
}

func (h *kafkaHarness) Start(_ context.Context, d adaptertest.Destination, w adaptertest.Work, opts adaptertest.ConsumerOptions) (adaptertest.Consumer, error) {
	const session = 2 * time.Second
	rc := kafkago.ReaderConfig{
		Brokers:           brokersOf(d),
		GroupID:           d.Params["group"],
		Topic:             d.Name,
		HeartbeatInterval: session / 15,
		SessionTimeout:    session,
		RebalanceTimeout:  2 * session,
		JoinGroupBackoff:  100 * time.Millisecond,
		MaxWait:           100 * time.Millisecond,
		ReadBackoffMin:    10 * time.Millisecond,
		ReadBackoffMax:    100 * time.Millisecond,
	}
	c, err := idemkafka.NewConsumer(rc, w.Handler, idemkafka.ConsumerOptions{
		DeadLetterTopic: d.DeadLetter,
		Workers:         4,
		Backoff:         opts.Backoff,
		CommitInterval:  100 * time.Millisecond,
		Telemetry:       consumer.Telemetry{Logger: slog.New(slog.DiscardHandler)},
	})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	kc := &kafkaConsumer{cancel: cancel, done: make(chan error, 1)}
	h.mu.Lock()
	kc.cluster = h.clusters[d.Name]
	h.mu.Unlock()
	go func() { kc.done <- c.Run(ctx) }()
	return kc, nil
}

type kafkaConsumer struct {
	cancel  context.CancelFunc
	done    chan error
	cluster *kfake.Cluster
}

func (c *kafkaConsumer) Stop(ctx context.Context) error {
	c.cancel()
	select {
	case err := <-c.done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("the consumer did not stop: %w", ctx.Err())
	}
}

// Interrupt makes kfake close the connection of each of the consumer's
// next fetches and heartbeats, until it has closed five.
func (c *kafkaConsumer) Interrupt(ctx context.Context) error {
	if c.cluster == nil {
		return fmt.Errorf("%w: on real brokers the harness has no way to drop the consumer's connections", adaptertest.ErrUnsupported)
	}
	var closed atomic.Int32
	c.cluster.Control(func(req kmsg.Request) (kmsg.Response, error, bool) {
		k := req.Key()
		if (k != int16(kmsg.Fetch) && k != int16(kmsg.Heartbeat)) || closed.Load() >= 5 {
			return nil, nil, false
		}
		c.cluster.KeepControl()
		closed.Add(1)
		return nil, errors.New("adaptertest: connection dropped"), true
	})
	for closed.Load() < 5 {
		select {
		case <-ctx.Done():
			return fmt.Errorf("the consumer sent no fetch or heartbeat to drop: %w", ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}

func (h *kafkaHarness) DeadLetters(ctx context.Context, d adaptertest.Destination) ([]adaptertest.DeadLetter, error) {
	tr := &kafkago.Transport{}
	defer tr.CloseIdleConnections()
	cl := &kafkago.Client{Addr: kafkago.TCP(brokersOf(d)...), Transport: tr, Timeout: 10 * time.Second}
	res, err := cl.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{d.DeadLetter: {kafkago.LastOffsetOf(0)}}})
	if err != nil {
		return nil, err
	}
	var end int64
	for _, p := range res.Topics[d.DeadLetter] {
		if p.Error != nil {
			return nil, p.Error
		}
		end = p.LastOffset
	}
	if end == 0 {
		return nil, nil
	}
	r := kafkago.NewReader(kafkago.ReaderConfig{Brokers: brokersOf(d), Topic: d.DeadLetter, Partition: 0, MaxWait: 100 * time.Millisecond})
	defer func() { _ = r.Close() }()
	var out []adaptertest.DeadLetter
	for {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			return nil, err
		}
		dl := adaptertest.DeadLetter{Payload: m.Value, Headers: map[string]string{}}
		for _, hd := range m.Headers {
			dl.Headers[hd.Key] = string(hd.Value)
		}
		dl.ID = dl.Headers[consumer.HeaderID]
		dl.Reason = dl.Headers[consumer.HeaderReason]
		dl.Attempts, _ = strconv.Atoi(dl.Headers[consumer.HeaderAttempts])
		out = append(out, dl)
		if m.Offset >= end-1 {
			return out, nil
		}
	}
}
