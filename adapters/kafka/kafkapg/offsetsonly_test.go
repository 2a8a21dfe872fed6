package kafkapg_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/adapters/kafka/kafkapg"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/kafkatest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

func newOffsets(t *testing.T, pool *pgxpool.Pool, schema string) *kafkapg.Offsets {
	t.Helper()
	o, err := kafkapg.NewOffsets(pool, kafkapg.OffsetsOptions{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return o
}

// TestOffsetsOnlyClaimRange: the position's compare-and-set answers, for
// each batch, the offset from which its records are new: all of them for
// a partition without a position and for the batch that follows the
// position, none for a batch delivered again, the tail of a batch that
// overlaps the position; a rolled-back batch leaves the position where it
// was.
func TestOffsetsOnlyClaimRange(t *testing.T) {
	pool := testenv.Pool(t, 4)
	o := newOffsets(t, pool, testenv.Schema(t, pool))
	ctx := testenv.Ctx(t)
	pos := func(off int64) idemkafka.Position {
		return idemkafka.Position{Group: "g", Topic: "t", Partition: 3, Offset: off}
	}
	for i, c := range []struct {
		name        string
		first, next int64 // the batch: records [first, next)
		commit      bool
		from        int64 // the first new record
		stored      int64 // the position afterwards
	}{
		{"no position yet", 0, 100, true, 0, 100},
		{"the next batch", 100, 200, true, 100, 200},
		{"the same batch again", 100, 200, true, 200, 200},
		{"a batch that overlaps the position", 150, 300, true, 200, 300},
		{"a batch after a gap", 350, 400, true, 350, 400},
		{"a batch rolled back", 400, 500, false, 400, 400},
		{"the batch again", 400, 500, true, 400, 500},
		{"an older batch", 0, 50, true, 500, 500},
	} {
		tx, from, err := kafkapg.ClaimRange(ctx, o, pool, pos(c.next), c.first)
		if err != nil {
			t.Fatalf("%d %s: %v", i, c.name, err)
		}
		end := tx.Rollback
		if c.commit {
			end = tx.Commit
		}
		if err := end(ctx); err != nil {
			t.Fatalf("%d %s: %v", i, c.name, err)
		}
		got, err := o.LoadOffsets(ctx, "g", "t", []int{3})
		if err != nil {
			t.Fatal(err)
		}
		if from != c.from || got[3] != c.stored {
			t.Fatalf("%d %s: new from %d, position %d; want %d and %d", i, c.name, from, got[3], c.from, c.stored)
		}
	}
}

// TestOffsetsOnlyConcurrentBatch: a batch of a partition whose position an
// open transaction holds (a member that lost the partition and still runs)
// waits for it, then sees the records as done when it committed, or new
// when it rolled back; with a position stored before, and without one.
func TestOffsetsOnlyConcurrentBatch(t *testing.T) {
	pool := testenv.Pool(t, 8)
	o := newOffsets(t, pool, testenv.Schema(t, pool))
	ctx := testenv.Ctx(t)
	if err := o.SaveOffsets(ctx, "g", map[string]map[int]int64{"t": {0: 100}}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		partition   int
		first, next int64
	}{{0, 100, 200}, {1, 0, 100}} {
		for _, commit := range []bool{true, false} {
			t.Run(fmt.Sprintf("partition=%d/commit=%v", c.partition, commit), func(t *testing.T) {
				pos := idemkafka.Position{Group: "g", Topic: "t", Partition: c.partition, Offset: c.next}
				first, from, err := kafkapg.ClaimRange(ctx, o, pool, pos, c.first)
				if err != nil || from != c.first {
					t.Fatalf("first claim: from %d, %v", from, err)
				}
				pid := first.Tx().Conn().PgConn().PID()
				type outcome struct {
					from int64
					err  error
				}
				done := make(chan outcome, 1)
				go func() {
					tx, from, err := kafkapg.ClaimRange(ctx, o, pool, pos, c.first)
					if err == nil {
						err = tx.Commit(ctx)
					}
					done <- outcome{from, err}
				}()
				testenv.Eventually(t, 30*time.Second, "the second claim to wait for the first", func() bool {
					var n int
					err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY (pg_blocking_pids(pid))", pid).Scan(&n)
					return err == nil && n == 1
				})
				select {
				case got := <-done:
					t.Fatalf("the second claim ended while the first was open: %d, %v", got.from, got.err)
				default:
				}
				want := c.first
				if commit {
					want = c.next
					err = first.Commit(ctx)
				} else {
					err = first.Rollback(ctx)
				}
				if err != nil {
					t.Fatal(err)
				}
				got := <-done
				if got.err != nil || got.from != want {
					t.Fatalf("second claim: new from %d, %v; want %d", got.from, got.err, want)
				}
				// Reset the partition for the next case.
				if _, err := pool.Exec(ctx, "UPDATE "+o.Table()+" SET next_offset = $1 WHERE partition = $2", c.first, c.partition); err != nil {
					t.Fatal(err)
				}
				if c.first == 0 {
					if _, err := pool.Exec(ctx, "DELETE FROM "+o.Table()+" WHERE partition = $1", c.partition); err != nil {
						t.Fatal(err)
					}
				}
			})
		}
	}
}

// offsetsEnv is a topic of records with the ids given, spread over two
// partitions, and an effects table that records each handled record's
// partition and offset.
type offsetsEnv struct {
	pool    *pgxpool.Pool
	k       *kafkatest.Env
	offsets *kafkapg.Offsets
	topic   string
	effects string
	recs    []kafkago.Message
}

func (e *offsetsEnv) insert(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
	ids, parts, offs := make([]string, len(msgs)), make([]string, len(msgs)), make([]string, len(msgs))
	for i, m := range msgs {
		ids[i], parts[i], offs[i] = m.ID, m.Metadata[idemkafka.MetadataPartition], m.Metadata[idemkafka.MetadataOffset]
	}
	_, err := tx.Exec(ctx, "INSERT INTO "+e.effects+" (id, partition, off) SELECT u.id, u.p::int, u.o::bigint FROM unnest($1::text[], $2::text[], $3::text[]) AS u(id, p, o)",
		ids, parts, offs)
	return err
}

// consume runs a BatchConsumer of group with handler bh until every record
// is done (acknowledged or dead-lettered), and returns the ids
// acknowledged as duplicates and the records dead-lettered.
func (e *offsetsEnv) consume(t *testing.T, group string, bh idemkafka.BatchHandler, resume bool) (dups []string, deadLettered int) {
	t.Helper()
	var (
		mu   sync.Mutex
		done atomic.Int64
	)
	opts := idemkafka.ConsumerOptions{
		DeadLetterTopic: e.topic + "_dlq", CommitEvery: 10, CommitInterval: 50 * time.Millisecond,
		Telemetry: consumer.Telemetry{
			OnOutcome: func(_ context.Context, r consumer.Report) {
				mu.Lock()
				defer mu.Unlock()
				switch r.Result.Action {
				case consumer.ActionAck:
					if r.Outcome == consumer.OutcomeDuplicate {
						dups = append(dups, r.Message.ID)
					}
				case consumer.ActionDeadLetter:
					deadLettered++
				default:
					return
				}
				done.Add(1)
			},
		},
	}
	if resume {
		opts.Offsets = e.offsets
	}
	c, err := idemkafka.NewBatchConsumer(kafkago.ReaderConfig{
		Brokers: e.k.Brokers, GroupID: group, Topic: e.topic,
		HeartbeatInterval: 100 * time.Millisecond, SessionTimeout: 10 * time.Second, RebalanceTimeout: 20 * time.Second,
		JoinGroupBackoff: 100 * time.Millisecond, MaxWait: 100 * time.Millisecond,
		ReadBackoffMin: 10 * time.Millisecond, ReadBackoffMax: 100 * time.Millisecond,
	}, bh, opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- c.Run(ctx) }()
	testenv.Eventually(t, 60*time.Second, "every record of "+group+" done", func() bool { return done.Load() == int64(len(e.recs)) })
	stop()
	if err := <-errc; err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("Run: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	return dups, deadLettered
}

// TestOffsetsOnlyConsumer: under a BatchConsumer, OffsetsOnly handles each
// record once, through a handler that fails once after its write and a
// record without an id in the middle of a batch; the group delivered
// everything again (its Kafka offsets deleted, the Consumer not resuming
// from the stored positions) runs no handler and writes nothing. A
// producer's duplicate, a second record with the same id, is handled
// twice: OffsetsOnly does not catch it.
func TestOffsetsOnlyConsumer(t *testing.T) {
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	e := &offsetsEnv{pool: pool, k: kafkatest.New(t), offsets: newOffsets(t, pool, schema)}
	e.effects = pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+e.effects+" (id text NOT NULL, partition int NOT NULL, off bigint NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	const partitions, unique, again = 2, 60, 10
	e.topic = e.k.Topic(t, "offsetsonly", partitions)
	e.k.CreateTopic(t, e.topic+"_dlq", 1)
	rec := func(p int, id string) kafkago.Message {
		m := kafkago.Message{Partition: p, Key: []byte(id), Value: []byte("v")}
		if id != "" {
			m.Headers = []kafkago.Header{{Key: outbox.HeaderMessageID, Value: []byte(id)}}
		}
		return m
	}
	for i := range unique {
		e.recs = append(e.recs, rec(i%partitions, fmt.Sprintf("m-%03d", i)))
		if i == unique/2 {
			e.recs = append(e.recs, rec(0, "")) // no id: dead-lettered, in the middle of partition 0
		}
	}
	for i := range again { // a producer's retries: new records, same ids
		e.recs = append(e.recs, rec(i%partitions, fmt.Sprintf("m-%03d", i)))
	}
	w := &kafkago.Writer{
		Addr: kafkago.TCP(e.k.Brokers...), Topic: e.topic, Transport: e.k.Transport, RequiredAcks: kafkago.RequireAll,
		Balancer: kafkago.BalancerFunc(func(m kafkago.Message, _ ...int) int { return m.Partition }),
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	err := w.WriteMessages(wctx, e.recs...)
	cancel()
	if cerr := w.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}

	var (
		mu      sync.Mutex
		calls   int
		batched bool
		crashed bool
	)
	bh, err := kafkapg.OffsetsOnly(pool, e.offsets, kafkapg.OffsetsOnlyOptions{},
		func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
			mu.Lock()
			calls++
			batched = batched || len(msgs) > 1
			crash := !crashed && len(msgs) > 1
			crashed = crashed || crash
			mu.Unlock()
			if err := e.insert(ctx, tx, msgs); err != nil {
				return err
			}
			if crash {
				return errors.New("crash after the write")
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	oracle := func() {
		t.Helper()
		var twice, rows, ids int
		if err := pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM (SELECT 1 FROM "+e.effects+" GROUP BY partition, off HAVING count(*) > 1) d), "+
			"(SELECT count(*) FROM "+e.effects+"), (SELECT count(DISTINCT id) FROM "+e.effects+")").Scan(&twice, &rows, &ids); err != nil {
			t.Fatal(err)
		}
		if twice != 0 || rows != unique+again || ids != unique {
			t.Errorf("%d records handled more than once, %d effects of %d ids; want 0, %d effects (a producer's %d duplicates included) of %d ids",
				twice, rows, ids, unique+again, again, unique)
		}
	}

	group := testenv.Name("g")
	dups, dl := e.consume(t, group, bh, true)
	if dl != 1 || len(dups) != 0 {
		t.Errorf("first run: %d dead-lettered, duplicates %v; want 1 and none", dl, dups)
	}
	mu.Lock()
	if !crashed || !batched {
		t.Errorf("no batch of several records reached the handler (crashed %v, batched %v)", crashed, batched)
	}
	first := calls
	mu.Unlock()
	oracle()
	got, err := e.offsets.LoadOffsets(ctx, group, e.topic, []int{0, 1})
	if err != nil {
		t.Fatal(err)
	}
	perPartition := map[int]int64{}
	for _, r := range e.recs {
		perPartition[r.Partition]++
	}
	if got[0] != perPartition[0] || got[1] != perPartition[1] {
		t.Errorf("stored positions %v, want %v", got, perPartition)
	}

	// The broker delivers every record again: the group's Kafka offsets
	// are gone and the Consumer does not resume from the stored positions.
	dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	res, err := e.k.Client.DeleteGroups(dctx, &kafkago.DeleteGroupsRequest{GroupIDs: []string{group}})
	cancel()
	if err == nil {
		err = res.Errors[group]
	}
	if err != nil {
		t.Fatalf("delete the group's Kafka offsets: %v", err)
	}
	dups, dl = e.consume(t, group, bh, false)
	if dl != 1 || len(dups) != len(e.recs)-1 {
		t.Errorf("run again: %d dead-lettered, %d duplicates; want 1 and %d", dl, len(dups), len(e.recs)-1)
	}
	mu.Lock()
	if calls != first {
		t.Errorf("the handler ran %d times on records delivered again, want 0", calls-first)
	}
	mu.Unlock()
	oracle()
}

// TestOffsetsOnlyOutsideConsumer: without a Consumer there is no position
// to claim: the batch is refused for good, and nothing runs.
func TestOffsetsOnlyOutsideConsumer(t *testing.T) {
	pool := testenv.Pool(t, 2)
	o := newOffsets(t, pool, testenv.Schema(t, pool))
	ran := false
	bh, err := kafkapg.OffsetsOnly(pool, o, kafkapg.OffsetsOnlyOptions{}, func(context.Context, pgx.Tx, []*consumer.Message) error {
		ran = true
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	err = bh(context.Background(), []*consumer.Message{{ID: "a", Metadata: map[string]string{idemkafka.MetadataOffset: strconv.Itoa(0)}}})
	if err == nil || consumer.Decide(err).Action != consumer.ActionDeadLetter || ran {
		t.Fatalf("OffsetsOnly outside a Consumer = %v (ran %v), want a permanent error", err, ran)
	}
	h := func(context.Context, pgx.Tx, []*consumer.Message) error { return nil }
	if _, err := kafkapg.OffsetsOnly(nil, o, kafkapg.OffsetsOnlyOptions{}, h); err == nil {
		t.Error("OffsetsOnly without a db accepted")
	}
	if _, err := kafkapg.OffsetsOnly(pool, nil, kafkapg.OffsetsOnlyOptions{}, h); err == nil {
		t.Error("OffsetsOnly without offsets accepted")
	}
	if _, err := kafkapg.OffsetsOnly(pool, o, kafkapg.OffsetsOnlyOptions{}, nil); err == nil {
		t.Error("OffsetsOnly without a handler accepted")
	}
}
