package pgoutbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	kafkago "github.com/segmentio/kafka-go"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/kafkatest"
	"github.com/idemkit/idem/internal/testkit/outboxtest"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// kafkaEnv is the Kafka the relay tests publish to (see kafkatest.New): an
// in-process kfake cluster, or the brokers of IDEM_TEST_KAFKA_BROKERS. Every
// Writer and Client of the tests uses its Transport, whose idle connections
// are closed when the test ends: kafka-go's DefaultTransport would keep them,
// and their goroutines, alive past goleak.
type kafkaEnv struct {
	brokers []string
	real    bool
	tr      *kafkago.Transport
	client  *kafkago.Client
	env     *kafkatest.Env
}

func newKafkaEnv(t testing.TB) *kafkaEnv {
	t.Helper()
	e := kafkatest.New(t)
	return &kafkaEnv{brokers: e.Brokers, real: e.Real, tr: e.Transport, client: e.Client, env: e}
}

// createTopic creates a fresh topic and waits for its partitions' leaders.
func (k *kafkaEnv) createTopic(t testing.TB, prefix string, partitions int) string {
	t.Helper()
	return k.env.Topic(t, prefix, partitions)
}

// deleteTopic deletes topic, so that kfake (which keeps records in the test
// process) does not grow from one benchmark round to the next.
func (k *kafkaEnv) deleteTopic(t testing.TB, topic string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := k.client.DeleteTopics(ctx, &kafkago.DeleteTopicsRequest{Topics: []string{topic}}); err != nil {
		t.Logf("delete topic %s: %v", topic, err)
	}
}

// writer returns a synchronous Writer that waits for every in-sync replica,
// sends a key's records to one partition (hash of the key), and takes each
// record's topic from the record. The caller closes it.
func (k *kafkaEnv) writer(batchSize int, batchTimeout time.Duration) *kafkago.Writer {
	return &kafkago.Writer{
		Addr:         kafkago.TCP(k.brokers...),
		Balancer:     &kafkago.Hash{},
		RequiredAcks: kafkago.RequireAll,
		BatchSize:    batchSize,
		BatchTimeout: batchTimeout,
		Transport:    k.tr,
	}
}

// kafkaPublisher is the relay's outbox.Publisher on w.
func kafkaPublisher(t testing.TB, w *kafkago.Writer) *idemkafka.Publisher {
	t.Helper()
	p, err := idemkafka.NewPublisher(w, idemkafka.PublisherOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// readerConfig is the consumer group configuration of the tests' Consumer:
// short waits, so that a test's consumer starts and stops quickly.
func (k *kafkaEnv) readerConfig(group, topic string) kafkago.ReaderConfig {
	heartbeat := 100 * time.Millisecond
	if k.real {
		heartbeat = 500 * time.Millisecond
	}
	return kafkago.ReaderConfig{
		Brokers:           k.brokers,
		GroupID:           group,
		Topic:             topic,
		HeartbeatInterval: heartbeat,
		SessionTimeout:    10 * time.Second,
		RebalanceTimeout:  20 * time.Second,
		JoinGroupBackoff:  100 * time.Millisecond,
		MaxWait:           100 * time.Millisecond,
		ReadBackoffMin:    10 * time.Millisecond,
		ReadBackoffMax:    100 * time.Millisecond,
	}
}

// kafkaRun runs a Consumer until the returned stop is called (or the test
// ends); stop waits for Run to return and may be called more than once.
func kafkaRun(t testing.TB, c *idemkafka.Consumer) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil && !errors.Is(err, context.Canceled) {
					t.Errorf("Consumer.Run: %v", err)
				}
			case <-time.After(60 * time.Second):
				t.Errorf("Consumer.Run did not return within 60s of its context ending")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// The relay publishes to Kafka (kfake in process, or IDEM_TEST_KAFKA_BROKERS)
// through adapters/kafka's Publisher 2,000 messages on 50 keys, enqueued by
// four concurrent producers whose transactions commit in another order than
// they enqueue, while other transactions enqueue and roll back. A consumer
// group (adapters/kafka Consumer, consumer.Transactional on dedup/pgtable)
// applies each message in the transaction of its claim to an oracle table
// with no unique constraint. Every committed message is applied exactly once,
// no rolled-back one is ever seen, and each key's messages are applied, and
// first delivered, in commit order.
func TestRelayToKafka(t *testing.T) {
	t.Parallel()
	const (
		total      = 2000
		keys       = 50
		partitions = 4
		rollbacks  = 5 // transactions of 3 messages each
	)
	pool := testenv.Pool(t, 12)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	schema := ob.Options().Schema
	k := newKafkaEnv(t)
	topic := k.createTopic(t, "idemtest_outbox", partitions)
	dlq := k.createTopic(t, "idemtest_outbox_dlq", 1)
	ctx := context.Background()

	// The oracle: one row per applied message, numbered in the order they
	// were applied. Within a key (one partition, handled one record after
	// another) that is the order of first delivery.
	eff := &effects{pool: pool, table: pgx.Identifier{schema, "kafka_effects"}.Sanitize()}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+eff.table+
		" (n bigserial, msg_id text NOT NULL, key text NOT NULL, payload text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	store, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	apply, err := consumer.Transactional(store, consumer.TxOptions{Scope: "ledger/apply"},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+eff.table+" (msg_id, key, payload) VALUES ($1, $2, $3)",
				m.ID, string(m.Key), string(m.Payload))
			return err
		})
	if err != nil {
		t.Fatal(err)
	}
	var (
		amu      sync.Mutex
		arrivals []outboxtest.Arrival // acknowledged deliveries, duplicates included
		dups     atomic.Int64
		dead     atomic.Int64
	)
	c, err := idemkafka.NewConsumer(k.readerConfig(testenv.Name("idemtest_g"), topic), consumer.Chain(apply, consumer.Recover()), idemkafka.ConsumerOptions{
		DeadLetterTopic: dlq,
		Telemetry: consumer.Telemetry{
			Logger: quiet(),
			OnOutcome: func(_ context.Context, rep consumer.Report) {
				m, r := rep.Message, rep.Result
				switch r.Action {
				case consumer.ActionAck:
					if r.Duplicate {
						dups.Add(1)
					}
					amu.Lock()
					arrivals = append(arrivals, outboxtest.Arrival{ID: m.ID, Key: string(m.Key), Body: bytes.Clone(m.Payload)})
					amu.Unlock()
				case consumer.ActionDeadLetter:
					dead.Add(1)
					t.Errorf("message %s dead-lettered: %v", m.ID, r.Err)
				}
			},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	stopConsumer := kafkaRun(t, c)

	w := k.writer(100, 5*time.Millisecond)
	t.Cleanup(func() { _ = w.Close() })
	mp := telemetrytest.NewMetrics(t)
	r, err := pgoutbox.NewRelay(ob, kafkaPublisher(t, w), fastRelay(pgoutbox.RelayOptions{
		Shards: 8, Sessions: 2, CleanupInterval: -1, Telemetry: consumer.Telemetry{MeterProvider: mp}, MetricsInterval: time.Hour,
	}))
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	relay := start(t, r)

	// Transactions that enqueue on the same keys and roll back, while the
	// producers run.
	rolledBack := make(chan []string, 1)
	rbErr := make(chan error, 1)
	go func() {
		var ids []string
		for i := range rollbacks {
			tx, err := pool.Begin(ctx)
			if err != nil {
				rbErr <- err
				return
			}
			got, err := ob.Enqueue(ctx, tx,
				msg(topic, keyOf(i*7, keys), fmt.Sprint("rollback/", 3*i)),
				msg(topic, keyOf(i*7+1, keys), fmt.Sprint("rollback/", 3*i+1)),
				msg(topic, keyOf(i*7+2, keys), fmt.Sprint("rollback/", 3*i+2)))
			time.Sleep(20 * time.Millisecond)
			_ = tx.Rollback(ctx)
			if err != nil {
				rbErr <- err
				return
			}
			ids = append(ids, got...)
		}
		rolledBack <- ids
	}()
	ids := enqueueStream(t, pool, ob, topic, total, keys, 4, 10, 2*time.Millisecond)
	var rbIDs []string
	select {
	case rbIDs = <-rolledBack:
	case err := <-rbErr:
		t.Fatalf("rolled-back transaction: %v", err)
	}
	if len(ids) != total || len(rbIDs) != 3*rollbacks {
		t.Fatalf("enqueued %d committed and %d rolled-back messages, want %d and %d", len(ids), len(rbIDs), total, 3*rollbacks)
	}

	applied := func() int {
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+eff.table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	testenv.Eventually(t, 60*time.Second, "every row marked published", func() bool { return countState(t, pool, ob, 1) == total })
	relayed := time.Since(began)
	testenv.Eventually(t, 60*time.Second, "every message applied downstream", func() bool { return applied() >= total })
	consumed := time.Since(began)
	relay.stop(t)
	stopConsumer()

	// Exactly once: no message applied twice, every committed one applied.
	var twice int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM (SELECT msg_id FROM "+eff.table+
		" GROUP BY msg_id HAVING count(*) > 1) d").Scan(&twice); err != nil {
		t.Fatal(err)
	}
	if twice != 0 {
		t.Errorf("%d messages applied more than once", twice)
	}
	got := eff.counts(t)
	if n := applied(); n != total || len(got) != total {
		t.Errorf("%d effects of %d distinct messages, want %d", n, len(got), total)
	}
	for _, id := range ids {
		if got[id] != 1 {
			t.Errorf("message %s applied %d times, want once", id, got[id])
		}
	}
	// Rolled back: never in the outbox, never delivered, never applied.
	rows := rowsByID(t, pool, ob)
	amu.Lock()
	snap := slices.Clone(arrivals)
	amu.Unlock()
	delivered := map[string]bool{}
	for _, a := range snap {
		delivered[a.ID] = true
	}
	for _, id := range rbIDs {
		if _, ok := rows[id]; ok || delivered[id] || got[id] != 0 {
			t.Errorf("rolled-back message %s seen (outbox row %v, delivered %v, applied %d times)", id, ok, delivered[id], got[id])
		}
	}

	// Per-key order: each key's messages by sequence, which is commit order
	// (and the outbox's own record of it)...
	want := map[string][]string{}
	obRows, err := pool.Query(ctx, "SELECT convert_from(key, 'UTF8'), id::text FROM "+ob.Table()+" ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	var key, id string
	if _, err := pgx.ForEachRow(obRows, []any{&key, &id}, func() error {
		want[key] = append(want[key], id)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// ... equals the order in which the consumer applied them...
	dbRows, err := pool.Query(ctx, "SELECT key, msg_id FROM "+eff.table+" ORDER BY n")
	if err != nil {
		t.Fatal(err)
	}
	appliedOrder := map[string][]string{}
	if _, err := pgx.ForEachRow(dbRows, []any{&key, &id}, func() error {
		appliedOrder[key] = append(appliedOrder[key], id)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// ... and the order of first delivery.
	firstOrder := map[string][]string{}
	seen := map[string]bool{}
	for _, a := range snap {
		if !seen[a.ID] {
			seen[a.ID] = true
			firstOrder[a.Key] = append(firstOrder[a.Key], a.ID)
		}
	}
	if len(want) != keys {
		t.Errorf("messages on %d keys, want %d", len(want), keys)
	}
	for k, ws := range want {
		if !slices.Equal(appliedOrder[k], ws) {
			t.Errorf("key %s: applied in another order than committed (%d applied, %d committed)", k, len(appliedOrder[k]), len(ws))
		}
		if !slices.Equal(firstOrder[k], ws) {
			t.Errorf("key %s: first delivered in another order than committed (%d delivered, %d committed)", k, len(firstOrder[k]), len(ws))
		}
	}
	distinct, _, violations, examples := orderReport(t, pool, ob, snap)
	if violations > 0 {
		t.Errorf("%d per-key order violations, e.g. %s", violations, strings.Join(examples, "; "))
	}
	p, retried, deadRows := counts(mp)
	broker := "kfake"
	if k.real {
		broker = "Kafka at " + strings.Join(k.brokers, ",")
	}
	t.Logf("%s, %d partitions: %d committed messages on %d keys (+%d rolled back): relayed in %v (%d published, %d retried, %d dead), "+
		"applied in %v: %d applied once, 0 twice, %d deliveries (%d duplicates dropped by the claim), %d dead-lettered, %d order violations, rolled-back never seen",
		broker, partitions, total, keys, len(rbIDs), relayed.Round(time.Millisecond), p, retried, deadRows,
		consumed.Round(time.Millisecond), distinct, len(snap), dups.Load(), dead.Load(), violations)
}
