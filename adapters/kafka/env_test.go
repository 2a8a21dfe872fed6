package idemkafka_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/internal/testkit/kafkatest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// kenv is the Kafka the tests talk to: an in-process kfake cluster, or the
// brokers in IDEM_TEST_KAFKA_BROKERS.
type kenv struct {
	brokers []string
	real    bool
	// session is the group session timeout of the in-process consumers:
	// long enough that a loaded machine does not miss it (members leave
	// cleanly, nothing waits for it to expire).
	session   time.Duration
	heartbeat time.Duration
	// childSession is the session timeout of the crash tests' child
	// processes: a SIGKILLed child leaves its group membership behind until
	// it expires, so the next child joins faster with a short one. kfake
	// accepts one this short; a real broker needs its
	// group.min.session.timeout.ms (6s by default).
	childSession time.Duration
	tr           *kafkago.Transport
	client       *kafkago.Client
	env          *kafkatest.Env
}

// newKafka returns the test Kafka (see kafkatest.New): kfake, closed when
// the test ends, unless IDEM_TEST_KAFKA_BROKERS names real brokers.
func newKafka(t testing.TB) *kenv {
	t.Helper()
	k := kafkatest.New(t)
	e := &kenv{brokers: k.Brokers, real: k.Real, tr: k.Transport, client: k.Client, env: k}
	if e.real {
		e.session, e.childSession, e.heartbeat = 10*time.Second, 6*time.Second, 500*time.Millisecond
	} else {
		e.session, e.childSession, e.heartbeat = 10*time.Second, 1500*time.Millisecond, 100*time.Millisecond
	}
	return e
}

// topic creates a fresh topic.
func (e *kenv) topic(t testing.TB, prefix string, partitions int) string {
	t.Helper()
	return e.env.Topic(t, prefix, partitions)
}

// dlq creates topic's dead-letter topic, named topic + "_dlq", and returns
// its name: a Consumer's Run checks that it exists.
func (e *kenv) dlq(t testing.TB, topic string) string {
	t.Helper()
	name := topic + "_dlq"
	e.env.CreateTopic(t, name, 1)
	return name
}

// readerConfig is the ReaderConfig the tests give the Consumer.
func (e *kenv) readerConfig(group, topic string) kafkago.ReaderConfig {
	return kafkago.ReaderConfig{
		Brokers:           e.brokers,
		GroupID:           group,
		Topic:             topic,
		HeartbeatInterval: e.heartbeat,
		SessionTimeout:    e.session,
		RebalanceTimeout:  2 * e.session,
		JoinGroupBackoff:  100 * time.Millisecond,
		MaxWait:           100 * time.Millisecond,
		ReadBackoffMin:    10 * time.Millisecond,
		ReadBackoffMax:    100 * time.Millisecond,
	}
}

// writer returns a Writer that sends each record to the partition in its
// Partition field.
func (e *kenv) writer(t testing.TB, topic string) *kafkago.Writer {
	t.Helper()
	w := &kafkago.Writer{
		Addr:         kafkago.TCP(e.brokers...),
		Topic:        topic,
		Balancer:     kafkago.BalancerFunc(func(m kafkago.Message, _ ...int) int { return m.Partition }),
		RequiredAcks: kafkago.RequireAll,
		BatchSize:    1000,
		BatchTimeout: 5 * time.Millisecond,
		Transport:    e.tr,
	}
	t.Cleanup(func() { _ = w.Close() })
	return w
}

// rec builds a record for partition p with the outbox id header (none when
// id is empty).
func rec(p int, key, id, value string) kafkago.Message {
	m := kafkago.Message{Partition: p, Key: []byte(key), Value: []byte(value)}
	if id != "" {
		m.Headers = []kafkago.Header{{Key: outbox.HeaderMessageID, Value: []byte(id)}}
	}
	return m
}

func (e *kenv) produce(t testing.TB, topic string, recs ...kafkago.Message) {
	t.Helper()
	w := e.writer(t, topic)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for len(recs) > 0 {
		n := min(len(recs), 5000)
		if err := w.WriteMessages(ctx, recs[:n]...); err != nil {
			t.Fatalf("produce: %v", err)
		}
		recs = recs[n:]
	}
}

// committed returns the group's committed offsets of topic's partitions (-1
// for none).
func (e *kenv) committed(t testing.TB, group, topic string, partitions int) []int64 {
	t.Helper()
	ps := make([]int, partitions)
	for i := range ps {
		ps[i] = i
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := e.client.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: ps}})
	if err == nil {
		err = res.Error
	}
	out := make([]int64, partitions)
	for i := range out {
		out[i] = -1
	}
	if errors.Is(err, kafkago.GroupIdNotFound) {
		return out // nothing committed yet
	}
	if err != nil {
		t.Fatalf("offset fetch: %v", err)
	}
	for _, p := range res.Topics[topic] {
		if p.Error == nil {
			out[p.Partition] = p.CommittedOffset
		}
	}
	return out
}

// ends returns the end offset of each partition.
func (e *kenv) ends(t testing.TB, topic string, partitions int) []int64 {
	t.Helper()
	req := make([]kafkago.OffsetRequest, partitions)
	for i := range req {
		req[i] = kafkago.LastOffsetOf(i)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := e.client.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{topic: req}})
	if err != nil {
		t.Fatalf("list offsets: %v", err)
	}
	out := make([]int64, partitions)
	for _, p := range res.Topics[topic] {
		if p.Error != nil {
			t.Fatalf("list offsets %s/%d: %v", topic, p.Partition, p.Error)
		}
		out[p.Partition] = p.LastOffset
	}
	return out
}

// readAll reads every record of topic.
func (e *kenv) readAll(t testing.TB, topic string, partitions int) []kafkago.Message {
	t.Helper()
	ends := e.ends(t, topic, partitions)
	var out []kafkago.Message
	for p, end := range ends {
		if end == 0 {
			continue
		}
		r := kafkago.NewReader(kafkago.ReaderConfig{Brokers: e.brokers, Topic: topic, Partition: p, MaxWait: 100 * time.Millisecond})
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			m, err := r.FetchMessage(ctx)
			cancel()
			if err != nil {
				_ = r.Close()
				t.Fatalf("read %s/%d: %v", topic, p, err)
			}
			out = append(out, m)
			if m.Offset >= end-1 {
				break
			}
		}
		_ = r.Close()
	}
	return out
}

// testLogger logs to t.Log, shown for failed tests and with -v.
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// eventually polls cond until it holds, failing the test after limit. It
// bounds a wait, it does not measure one.
func eventually(t testing.TB, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	testenv.Eventually(t, limit, what, cond)
}

// running runs c until the test ends (or stop is called) and fails the test
// if Run returns an error.
type running struct {
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
}

func run(t testing.TB, c interface {
	Run(context.Context) error
}) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- c.Run(ctx) }()
	t.Cleanup(func() { r.stop(t) })
	return r
}

// stop cancels Run and waits for it to return.
func (r *running) stop(t testing.TB) {
	t.Helper()
	r.once.Do(func() {
		r.cancel()
		select {
		case err := <-r.done:
			if err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(60 * time.Second):
			t.Errorf("Run did not return within 60s of its context ending")
		}
	})
}

func ids(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%06d", prefix, i)
	}
	return out
}
