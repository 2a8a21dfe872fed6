package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	kafkago "github.com/segmentio/kafka-go"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/adapters/kafka/kafkapg"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// kafkaPartitions is the partition count of every topic: both sides handle
// the partitions in parallel, one goroutine each.
const kafkaPartitions = 6

// kafkaBroker is a kfake cluster in a child process.
type kafkaBroker struct {
	cmd    *exec.Cmd
	addr   string
	client *kafkago.Client
}

// startKafka runs the kfake command and reads the broker's address from
// its first line of output.
func startKafka(bin string) (*kafkaBroker, error) {
	if bin == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		bin = filepath.Join(filepath.Dir(exe), "kfake")
	}
	// The broker stops when its stdin closes: when stop closes it, or
	// when this process dies.
	cmd := exec.Command(bin, "-stdin")
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if _, err := cmd.StdinPipe(); err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the kfake broker (%s; scripts/bench.sh builds it): %w", bin, err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, fmt.Errorf("kfake broker: %w", err)
	}
	k := &kafkaBroker{cmd: cmd, addr: strings.TrimSpace(line)}
	k.client = &kafkago.Client{Addr: kafkago.TCP(k.addr), Timeout: 30 * time.Second}
	return k, nil
}

func (k *kafkaBroker) stop() {
	_ = k.cmd.Process.Signal(os.Interrupt)
	done := make(chan struct{})
	go func() { _ = k.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = k.cmd.Process.Kill()
		<-done
	}
}

// broker starts the run's broker on first use.
func (e *env) broker() (*kafkaBroker, error) {
	if e.kafka == nil {
		k, err := startKafka(e.cfg.Kfake)
		if err != nil {
			return nil, err
		}
		e.kafka = k
	}
	return e.kafka, nil
}

// topic creates a topic holding n records spread over the partitions, and
// its dead-letter topic (idem's consumer checks that it exists). Each
// record's key and outbox.HeaderMessageID header carry its id. It returns
// the topic and a function that deletes both.
func (k *kafkaBroker) topic(ctx context.Context, n int) (string, func(), error) {
	name := testenv.Name("idembench")
	del := func() {
		_, _ = k.client.DeleteTopics(context.Background(), &kafkago.DeleteTopicsRequest{Topics: []string{name, name + "_dlq"}})
	}
	res, err := k.client.CreateTopics(ctx, &kafkago.CreateTopicsRequest{Topics: []kafkago.TopicConfig{
		{Topic: name, NumPartitions: kafkaPartitions, ReplicationFactor: 1},
		{Topic: name + "_dlq", NumPartitions: 1, ReplicationFactor: 1},
	}})
	if err == nil {
		err = errors.Join(res.Errors[name], res.Errors[name+"_dlq"])
	}
	if err != nil {
		return "", del, err
	}
	w := &kafkago.Writer{Addr: kafkago.TCP(k.addr), Topic: name, RequiredAcks: kafkago.RequireAll, BatchSize: 1000,
		BatchTimeout: 5 * time.Millisecond, Balancer: kafkago.BalancerFunc(func(m kafkago.Message, _ ...int) int { return m.Partition })}
	defer func() { _ = w.Close() }()
	recs := make([]kafkago.Message, 0, 5000)
	for i := range n {
		// Time-ordered ids, as idem's outbox writes them.
		u, err := uuid.NewV7()
		if err != nil {
			return "", del, err
		}
		id := u.String()
		recs = append(recs, kafkago.Message{Partition: i % kafkaPartitions, Key: []byte(id), Value: payload,
			Headers: []kafkago.Header{{Key: outbox.HeaderMessageID, Value: []byte(id)}}})
		if len(recs) == cap(recs) || i == n-1 {
			if err := w.WriteMessages(ctx, recs...); err != nil {
				return "", del, fmt.Errorf("produce: %w", err)
			}
			recs = recs[:0]
		}
	}
	return name, del, nil
}

func (k *kafkaBroker) readerConfig(topic string) kafkago.ReaderConfig {
	return kafkago.ReaderConfig{
		Brokers: []string{k.addr}, GroupID: testenv.Name("g"), Topic: topic,
		HeartbeatInterval: 500 * time.Millisecond, SessionTimeout: 10 * time.Second, RebalanceTimeout: 20 * time.Second,
		JoinGroupBackoff: 100 * time.Millisecond, MaxWait: 100 * time.Millisecond,
		ReadBackoffMin: 10 * time.Millisecond, ReadBackoffMax: 100 * time.Millisecond,
	}
}

// kafkaSide produces a fresh topic for each round and times consume on it.
func kafkaSide(e *env, consume func(ctx context.Context, k *kafkaBroker, topic string, n int) (float64, error)) side {
	return func(ctx context.Context, warm bool) (float64, error) {
		k, err := e.broker()
		if err != nil {
			return 0, err
		}
		n := warmed(e.size.records, warm)
		topic, del, err := k.topic(ctx, n)
		defer del()
		if err != nil {
			return 0, err
		}
		return consume(ctx, k, topic, n)
	}
}

// kafkaBare is the consumer a user writes with kafka-go: one group Reader
// whose records go to one goroutine per partition; each goroutine hands
// its records to work (one at a time, or what has arrived up to 100 at
// once when batch is set) and commits the offset once 100 records of its
// partition are done since the last commit.
func kafkaBare(ctx context.Context, k *kafkaBroker, topic string, n int, batch bool, work func(ctx context.Context, ms []kafkago.Message) error) (float64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	r := kafkago.NewReader(k.readerConfig(topic))
	defer func() { _ = r.Close() }()
	m := newMeter(n)
	errc := make(chan error, kafkaPartitions+1)
	parts := make([]chan kafkago.Message, kafkaPartitions)
	for p := range parts {
		parts[p] = make(chan kafkago.Message, 256)
		go func(in <-chan kafkago.Message) {
			since := 0
			ms := make([]kafkago.Message, 0, 100)
			for {
				select {
				case <-ctx.Done():
					return
				case msg := <-in:
					ms = append(ms[:0], msg)
					for batch && len(ms) < cap(ms) && len(in) > 0 {
						ms = append(ms, <-in)
					}
				}
				if err := work(ctx, ms); err != nil {
					errc <- err
					return
				}
				if since += len(ms); since >= 100 {
					if err := r.CommitMessages(ctx, ms[len(ms)-1]); err != nil {
						errc <- err
						return
					}
					since = 0
				}
				for range ms {
					m.tick()
				}
			}
		}(parts[p])
	}
	go func() {
		for {
			msg, err := r.FetchMessage(ctx)
			if err != nil {
				errc <- err
				return
			}
			select {
			case parts[msg.Partition] <- msg:
			case <-ctx.Done():
				return
			}
		}
	}()
	return m.wait(ctx, errc)
}

// kafkaIdem runs idem's Consumer (or BatchConsumer, when h is a
// BatchHandler) until n records are acknowledged.
func kafkaIdem(ctx context.Context, e *env, k *kafkaBroker, topic string, n int, h any, offsets *kafkapg.Offsets) (float64, error) {
	m := newMeter(n)
	opts := idemkafka.ConsumerOptions{
		CommitEvery: 100, DeadLetterTopic: topic + "_dlq",
		Telemetry: consumer.Telemetry{
			Logger: e.log,
			OnOutcome: func(_ context.Context, r consumer.Report) {
				if r.Result.Action == consumer.ActionAck {
					m.tick()
				}
			},
		},
	}
	var c *idemkafka.Consumer
	var err error
	switch h := h.(type) {
	case consumer.Handler:
		c, err = idemkafka.NewConsumer(k.readerConfig(topic), h, opts)
	case idemkafka.BatchHandler:
		opts.Offsets = offsets
		c, err = idemkafka.NewBatchConsumer(k.readerConfig(topic), h, opts)
	}
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithCancel(ctx)
	errc := make(chan error, 1)
	go func() { errc <- c.Run(ctx) }()
	rate, err := m.wait(ctx, errc)
	cancel()
	if rerr := <-errc; err == nil && rerr != nil && !errors.Is(rerr, context.Canceled) {
		err = rerr
	}
	return rate, err
}

// claims returns a pgtable store on a fresh table of the run's schema.
func (e *env) claims(ctx context.Context, name string, opts pgtable.Options) (*pgtable.Store, error) {
	opts.Schema, opts.Table, opts.Logger = e.schema, name, e.log
	s, err := pgtable.New(e.pool, opts)
	if err != nil {
		return nil, err
	}
	return s, s.Migrate(ctx)
}

// insertEffect is the consumer rows' business write in the transaction of
// the claim.
// txSides makes the tables of a transactional row whose tables are named
// after prefix: the baseline's INSERT into its own effects table, and idem's
// handler, consumer.Transactional on a fresh claims table doing the same
// INSERT into another.
func (e *env) txSides(ctx context.Context, prefix, scope string) (bareInsert string, h consumer.Handler, err error) {
	bareInsert, err = e.effects(ctx, prefix+"_bare")
	if err != nil {
		return "", nil, err
	}
	idemInsert, err := e.effects(ctx, prefix+"_idem")
	if err != nil {
		return "", nil, err
	}
	claims, err := e.claims(ctx, prefix+"_claims", pgtable.Options{})
	if err != nil {
		return "", nil, err
	}
	h, err = consumer.Transactional(claims, consumer.TxOptions{Scope: scope}, insertEffect(idemInsert))
	return bareInsert, h, err
}

func insertEffect(insert string) consumer.TxHandler[pgx.Tx] {
	return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		_, err := tx.Exec(ctx, insert, msg.ID, msg.Payload)
		return err
	}
}

func kafkaTxRow() row {
	return row{
		path:     "Kafka, per-record transactional claim (consumer.Transactional)",
		baseline: "kafka-go group Reader, a goroutine per partition, one tx per record, commit every 100",
		target:   0.90, unit: "msg/s", floor: txFloor,
		build: func(ctx context.Context, e *env) (side, side, error) {
			bareInsert, h, err := e.txSides(ctx, "kafka_tx", "bench/kafka")
			if err != nil {
				return nil, nil, err
			}
			bare := kafkaSide(e, func(ctx context.Context, k *kafkaBroker, topic string, n int) (float64, error) {
				return kafkaBare(ctx, k, topic, n, false, func(ctx context.Context, ms []kafkago.Message) error {
					return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
						_, err := tx.Exec(ctx, bareInsert, string(ms[0].Key), ms[0].Value)
						return err
					})
				})
			})
			idem := kafkaSide(e, func(ctx context.Context, k *kafkaBroker, topic string, n int) (float64, error) {
				return kafkaIdem(ctx, e, k, topic, n, h, nil)
			})
			return bare, idem, nil
		},
	}
}

// batchKind is the variant of the Kafka batch rows.
type batchKind int

const (
	batchAll         batchKind = iota // kafkapg.BatchAll, business tables with a primary key
	batchAllNoPK                      // kafkapg.BatchAll, business tables without an index (reference)
	batchOffsetsOnly                  // kafkapg.OffsetsOnly, business tables with a primary key
)

func kafkaBatchRow() row       { return kafkaBatch(batchAll) }
func kafkaBatchNoPKRow() row   { return kafkaBatch(batchAllNoPK) }
func kafkaOffsetsOnlyRow() row { return kafkaBatch(batchOffsetsOnly) }

// kafkaBatch is a row of the Kafka batch path: the baseline is kafka-go's
// Reader with one transaction per fetched batch inserting the records with
// unnest; idem's side writes the same rows through kafkapg.BatchAll (with
// claims in pgtable, TimeOrderedKeys, the records' ids being UUIDv7) or
// kafkapg.OffsetsOnly, with the positions in PostgreSQL.
func kafkaBatch(kind batchKind) row {
	r := row{
		path:     "Kafka, batch claim + offsets in PostgreSQL (kafkapg.BatchAll, time-ordered keys)",
		baseline: "same Reader, one tx per fetched batch (up to 100) inserting the rows with unnest into a table with a primary key on the id (UUIDv7)",
		target:   0.85, unit: "msg/s", floor: batchFloor,
	}
	cols := "id text PRIMARY KEY, payload bytea, at timestamptz NOT NULL DEFAULT now()"
	switch kind {
	case batchAllNoPK:
		r.path = "Kafka, batch claim + offsets in PostgreSQL (kafkapg.BatchAll, time-ordered keys), business tables without an index (reference)"
		r.baseline = "same Reader, one tx per fetched batch (up to 100) inserting the rows with unnest into a table without an index"
		r.floor = batchNoPKFloor
		cols = "id text NOT NULL, payload bytea, at timestamptz NOT NULL DEFAULT now()"
	case batchOffsetsOnly:
		r.path = "Kafka, batch with offsets only, broker redelivery only (kafkapg.OffsetsOnly)"
		r.target = 0.95
		r.floor = offsetsOnlyFloor
	}
	prefix := [...]string{"kafka_batch", "kafka_batch_nopk", "kafka_offsets_only"}[kind]
	r.build = func(ctx context.Context, e *env) (side, side, error) {
		bareTable, err := e.table(ctx, prefix+"_bare", cols)
		if err != nil {
			return nil, nil, err
		}
		idemTable, err := e.table(ctx, prefix+"_idem", cols)
		if err != nil {
			return nil, nil, err
		}
		offsets, err := kafkapg.NewOffsets(e.pool, kafkapg.OffsetsOptions{Schema: e.schema, Table: prefix + "_offsets"})
		if err == nil {
			err = offsets.Migrate(ctx)
		}
		if err != nil {
			return nil, nil, err
		}
		unnest := "INSERT INTO " + bareTable + " (id, payload) SELECT * FROM unnest($1::text[], $2::bytea[])"
		idemUnnest := "INSERT INTO " + idemTable + " (id, payload) SELECT * FROM unnest($1::text[], $2::bytea[])"
		insertAll := func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
			ids, payloads := make([]string, len(msgs)), make([][]byte, len(msgs))
			for i, m := range msgs {
				ids[i], payloads[i] = m.ID, m.Payload
			}
			_, err := tx.Exec(ctx, idemUnnest, ids, payloads)
			return err
		}
		var bh idemkafka.BatchHandler
		if kind == batchOffsetsOnly {
			bh, err = kafkapg.OffsetsOnly(e.pool, offsets, kafkapg.OffsetsOnlyOptions{Scope: "bench/kafka"}, insertAll)
		} else {
			claims, cerr := e.claims(ctx, prefix+"_claims", pgtable.Options{TimeOrderedKeys: true})
			if cerr != nil {
				return nil, nil, cerr
			}
			bh, err = kafkapg.BatchAll(e.pool, claims, kafkapg.BatchOptions{Scope: "bench/kafka", Offsets: offsets}, insertAll)
		}
		if err != nil {
			return nil, nil, err
		}
		bare := kafkaSide(e, func(ctx context.Context, k *kafkaBroker, topic string, n int) (float64, error) {
			return kafkaBare(ctx, k, topic, n, true, func(ctx context.Context, ms []kafkago.Message) error {
				ids, payloads := make([]string, len(ms)), make([][]byte, len(ms))
				for i, m := range ms {
					ids[i], payloads[i] = string(m.Key), m.Value
				}
				return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, unnest, ids, payloads)
					return err
				})
			})
		})
		idem := kafkaSide(e, func(ctx context.Context, k *kafkaBroker, topic string, n int) (float64, error) {
			return kafkaIdem(ctx, e, k, topic, n, bh, offsets)
		})
		return bare, idem, nil
	}
	return r
}
