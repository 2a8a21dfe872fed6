package chaos

import (
	"context"
	"errors"
	"fmt"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
)

// Kafka SIGKILL cells: adapters/kafka consumer children in one group on a
// kfake cluster that lives in the runner (it listens on TCP, so the
// children connect to it like to any broker).

const (
	kafkaPartitions = 4
	// kafkaSession is the children's group session timeout: a SIGKILLed
	// child's membership lingers this long, so keep it short (kfake accepts
	// it with GroupMinSessionTimeout).
	kafkaSession = 1500 * time.Millisecond
)

// kafkaEnv is a kfake cluster and a client of it.
type kafkaEnv struct {
	cluster *kfake.Cluster
	brokers []string
	tr      *kafkago.Transport
	client  *kafkago.Client
}

func newKafkaEnv() (*kafkaEnv, error) { return newKafkaEnvN(1) }

// newKafkaEnvN is newKafkaEnv with n brokers.
func newKafkaEnvN(n int) (*kafkaEnv, error) {
	c, err := kfake.NewCluster(kfake.NumBrokers(n), kfake.GroupMinSessionTimeout(100*time.Millisecond))
	if err != nil {
		return nil, fmt.Errorf("kfake: %w", err)
	}
	k := &kafkaEnv{cluster: c, brokers: c.ListenAddrs(), tr: &kafkago.Transport{}}
	k.client = &kafkago.Client{Addr: kafkago.TCP(k.brokers...), Transport: k.tr, Timeout: 10 * time.Second}
	return k, nil
}

func (k *kafkaEnv) close() {
	k.tr.CloseIdleConnections()
	k.cluster.Close()
}

// createTopic creates topic and waits until its partitions have a leader.
func (k *kafkaEnv) createTopic(ctx context.Context, topic string, partitions int) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	res, err := k.client.CreateTopics(ctx, &kafkago.CreateTopicsRequest{
		Topics: []kafkago.TopicConfig{{Topic: topic, NumPartitions: partitions, ReplicationFactor: 1}},
	})
	if err == nil {
		err = res.Errors[topic]
	}
	if err != nil {
		return fmt.Errorf("create topic %s: %w", topic, err)
	}
	for {
		md, err := k.client.Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{topic}})
		if err == nil && len(md.Topics) == 1 && md.Topics[0].Error == nil && len(md.Topics[0].Partitions) == partitions {
			ok := true
			for _, p := range md.Topics[0].Partitions {
				ok = ok && p.Error == nil && p.Leader.Host != ""
			}
			if ok {
				return nil
			}
		}
		if ctx.Err() != nil {
			if err == nil {
				err = ctx.Err()
			}
			return fmt.Errorf("topic %s has no leaders: %w", topic, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// writer returns a synchronous Writer that sends each record to the
// partition in its Partition field.
func (k *kafkaEnv) writer(topic string) *kafkago.Writer {
	return &kafkago.Writer{
		Addr:         kafkago.TCP(k.brokers...),
		Topic:        topic,
		Balancer:     kafkago.BalancerFunc(func(m kafkago.Message, _ ...int) int { return m.Partition }),
		RequiredAcks: kafkago.RequireAll,
		BatchSize:    1000,
		BatchTimeout: 5 * time.Millisecond,
		Transport:    k.tr,
	}
}

// ends returns the end offset of each partition of topic.
func (k *kafkaEnv) ends(ctx context.Context, topic string, partitions int) ([]int64, error) {
	req := make([]kafkago.OffsetRequest, partitions)
	for i := range req {
		req[i] = kafkago.LastOffsetOf(i)
	}
	res, err := k.client.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{topic: req}})
	if err != nil {
		return nil, err
	}
	out := make([]int64, partitions)
	for _, p := range res.Topics[topic] {
		if p.Error != nil {
			return nil, fmt.Errorf("list offsets %s/%d: %w", topic, p.Partition, p.Error)
		}
		out[p.Partition] = p.LastOffset
	}
	return out, nil
}

// committed returns the group's committed offsets (-1 for none).
func (k *kafkaEnv) committed(ctx context.Context, group, topic string, partitions int) ([]int64, error) {
	ps := make([]int, partitions)
	for i := range ps {
		ps[i] = i
	}
	out := make([]int64, partitions)
	for i := range out {
		out[i] = -1
	}
	res, err := k.client.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: ps}})
	if err == nil {
		err = res.Error
	}
	if errors.Is(err, kafkago.GroupIdNotFound) {
		return out, nil
	}
	if err != nil {
		return nil, err
	}
	for _, p := range res.Topics[topic] {
		if p.Error == nil {
			out[p.Partition] = p.CommittedOffset
		}
	}
	return out, nil
}

// caughtUp reports whether group committed every partition of topic to its
// end.
func (k *kafkaEnv) caughtUp(ctx context.Context, group, topic string, partitions int) (bool, error) {
	ends, err := k.ends(ctx, topic, partitions)
	if err != nil {
		return false, err
	}
	com, err := k.committed(ctx, group, topic, partitions)
	if err != nil {
		return false, err
	}
	for i := range ends {
		if com[i] != ends[i] {
			return false, nil
		}
	}
	return true, nil
}

// empty returns an error when topic holds records (a dead-letter topic).
func (k *kafkaEnv) empty(ctx context.Context, topic string, partitions int) error {
	ends, err := k.ends(ctx, topic, partitions)
	if err != nil {
		return err
	}
	var n int64
	for _, e := range ends {
		n += e
	}
	if n > 0 {
		return fmt.Errorf("%d records in %s", n, topic)
	}
	return nil
}

// kafkaReaderConfig is the consumer configuration of the cells' consumers.
func kafkaReaderConfig(brokers []string, group, topic string, session time.Duration) kafkago.ReaderConfig {
	return kafkago.ReaderConfig{
		Brokers:           brokers,
		GroupID:           group,
		Topic:             topic,
		HeartbeatInterval: session / 15,
		SessionTimeout:    session,
		RebalanceTimeout:  2 * session,
		JoinGroupBackoff:  100 * time.Millisecond,
		MaxWait:           100 * time.Millisecond,
		ReadBackoffMin:    10 * time.Millisecond,
		ReadBackoffMax:    100 * time.Millisecond,
	}
}

// kafkaWorkload feeds a topic consumed by kafka-consumer children (or
// kafka-consumer-offsets children: positions in PostgreSQL through
// kafkapg). A stall detector watches the group for the whole cell.
type kafkaWorkload struct {
	b          *cellBase
	k          *kafkaEnv
	topic      string
	group      string
	partitions int
	childName  string
	w          *kafkago.Writer
	next       int
	stall      *stallDetector
	closer     func()
}

func newKafkaWorkload(ctx context.Context, b *cellBase, childName string, partitions, brokers int) (*kafkaWorkload, error) {
	k, err := newKafkaEnvN(brokers)
	if err != nil {
		return nil, err
	}
	w := &kafkaWorkload{b: b, k: k, topic: "chaos_" + b.suffix, group: "chaos_g_" + b.suffix, partitions: partitions, childName: childName}
	if err := k.createTopic(ctx, w.topic, partitions); err != nil {
		k.close()
		return nil, err
	}
	if err := k.createTopic(ctx, w.topic+"_dlq", 1); err != nil {
		k.close()
		return nil, err
	}
	w.w = k.writer(w.topic)
	w.stall = startStallDetector(ctx, k, w.group, w.topic, partitions, b.env.TempDir, stallBound)
	w.closer = func() {
		w.stall.close()
		_ = w.w.Close()
		k.close()
	}
	return w, nil
}

func (w *kafkaWorkload) child() string { return w.childName }

func (w *kafkaWorkload) config(int) childConfig {
	c := w.b.config()
	c.Brokers, c.Topic, c.Group = w.k.brokers, w.topic, w.group
	return c
}

func (w *kafkaWorkload) produce(ctx context.Context, ids []string) error {
	recs := make([]kafkago.Message, 0, len(ids))
	for _, id := range ids {
		recs = append(recs, kafkago.Message{
			Partition: w.next % w.partitions,
			Key:       []byte(id),
			Value:     []byte("payload-" + id),
			Headers:   []kafkago.Header{{Key: outbox.HeaderMessageID, Value: []byte(id)}},
		})
		w.next++
	}
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	return w.w.WriteMessages(ctx, recs...)
}

func (w *kafkaWorkload) progress(ctx context.Context) (int, error) {
	if err := w.stall.failed(); err != nil {
		return 0, err
	}
	return w.b.distinctEffects(ctx)
}

func (w *kafkaWorkload) drained(ctx context.Context, _ time.Duration) (bool, error) {
	if err := w.stall.failed(); err != nil {
		return false, err
	}
	var ok bool
	err := retryStale(ctx, func() (err error) {
		ok, err = w.k.caughtUp(ctx, w.group, w.topic, w.partitions)
		return err
	})
	return ok, err
}

func (w *kafkaWorkload) settle(ctx context.Context) error {
	var ok bool
	err := retryStale(ctx, func() (err error) {
		ok, err = w.k.caughtUp(ctx, w.group, w.topic, w.partitions)
		return err
	})
	if err != nil {
		return err
	}
	if !ok {
		return errors.New("the group's committed offsets fell behind the ends after the children stopped")
	}
	return retryStale(ctx, func() error { return w.k.empty(ctx, w.topic+"_dlq", 1) })
}

// retryStale runs fn until it succeeds, for up to 30s: the runner's
// client asks the broker its metadata name, which may no longer lead the
// partition or coordinate the group when leaders move (the failover cell);
// the client's metadata catch up within seconds.
func retryStale(ctx context.Context, fn func() error) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := fn()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		if err := sleepCtx(ctx, 200*time.Millisecond); err != nil {
			return err
		}
	}
}

// kafkaChild is the kafka-consumer child: an adapters/kafka Consumer with
// the cell's handler.
func kafkaChild(ctx context.Context) error {
	r, err := newChildRun(ctx)
	if err != nil {
		return err
	}
	defer r.quit()
	stopDump, err := dumpGoroutinesOn(r.cfg.Log)
	if err != nil {
		return err
	}
	defer stopDump()
	pool, err := childPool(r.ctx, r.cfg.PGURL, 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	h, closer, err := brokerHandler(r, pool)
	if err != nil {
		return err
	}
	defer closer()
	return runKafkaChild(r, h, nil)
}

// runKafkaChild runs the cells' Consumer with h (and offsets, when set)
// until SIGTERM.
func runKafkaChild(r *childRun, h consumer.Handler, offsets idemkafka.OffsetStore) error {
	c, err := idemkafka.NewConsumer(kafkaReaderConfig(r.cfg.Brokers, r.cfg.Group, r.cfg.Topic, kafkaSession), h, idemkafka.ConsumerOptions{
		CommitEvery:     50,
		CommitInterval:  100 * time.Millisecond,
		Backoff:         consumer.Backoff{Initial: 50 * time.Millisecond, Max: time.Second},
		DeadLetterTopic: r.cfg.Topic + "_dlq",
		Offsets:         offsets,
		Telemetry: consumer.Telemetry{
			Logger: childLogger(),
		},
	})
	if err != nil {
		return err
	}
	r.ready()
	return r.done(c.Run(r.ctx))
}

// kafkaCell is a Kafka consumer SIGKILL cell.
func kafkaCell(name, store string) Cell {
	return Cell{
		Name:             name,
		ExpectDuplicates: store == storeRedis,
		Run: func(ctx context.Context, env *Env) (Result, error) {
			n, kills := env.Pick(1000, 20000), env.Pick(8, 40)
			return withBase(ctx, env, name, store, n, func(b *cellBase) (Result, error) {
				w, err := newKafkaWorkload(ctx, b, "kafka-consumer", kafkaPartitions, 1)
				if err != nil {
					return Result{}, err
				}
				defer w.closer()
				return killCell(ctx, b, w, killSpec{
					kills: kills, workers: 2, points: consumerPoints,
					named: 8 * time.Second, limit: time.Duration(env.Pick(90, 600)) * time.Second,
				})
			})
		},
	}
}
