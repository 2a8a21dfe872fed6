package idemkafka_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	kafkago "github.com/segmentio/kafka-go"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/adapters/kafka/kafkapg"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestRebalance: three consumers of one group join and leave while records
// are produced and handled (pgtable's Transactional handler, with a few ms
// of work per record so that rebalances meet work in flight): no effect
// applied twice, none lost, and each member handled some.
func TestRebalance(t *testing.T) {
	k := newKafka(t)
	setup := testenv.Pool(t, 2)
	schema := testenv.Schema(t, setup)
	ctx := context.Background()
	claims, err := pgtable.New(setup, pgtable.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := claims.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := setup.Exec(ctx, "CREATE TABLE "+effects+" (id text NOT NULL, member integer NOT NULL, part integer NOT NULL, off bigint NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	const partitions, n = 6, 3000
	topic := k.topic(t, "rebalance", partitions)
	dlq := k.dlq(t, topic)
	group := testenv.Name("g")
	all := ids("r", n)

	// The producer: chunks of 100 records every 20ms, with a re-publish
	// of an earlier id in every chunk.
	produced := make(chan struct{})
	go func() {
		defer close(produced)
		w := k.writer(t, topic)
		for c := 0; c < n/100; c++ {
			var recs []kafkago.Message
			for i := c * 100; i < (c+1)*100; i++ {
				recs = append(recs, rec(i%partitions, all[i], all[i], "payload-"+all[i]))
			}
			j := rand.IntN((c + 1) * 100)
			recs = append(recs, rec(j%partitions, all[j], all[j], "payload-"+all[j]))
			if err := w.WriteMessages(ctx, recs...); err != nil {
				t.Errorf("produce: %v", err)
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()

	var total atomic.Int64
	perMember := make([]atomic.Int64, 3)
	member := func(i int) (*idemkafka.Consumer, *running) {
		pool := testenv.Pool(t, 4)
		store, err := pgtable.New(pool, pgtable.Options{Schema: schema})
		if err != nil {
			t.Fatal(err)
		}
		h, err := consumer.Transactional(store, consumer.TxOptions{Scope: "test/rebalance"},
			func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
				p, _ := strconv.Atoi(msg.Metadata[idemkafka.MetadataPartition])
				if _, err := tx.Exec(ctx, "INSERT INTO "+effects+" (id, member, part, off) VALUES ($1, $2, $3, $4)",
					msg.ID, i, p, offsetOf(t, msg)); err != nil {
					return err
				}
				time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond)
				return nil
			})
		if err != nil {
			t.Fatal(err)
		}
		c, err := idemkafka.NewConsumer(k.readerConfig(group, topic), h, idemkafka.ConsumerOptions{
			CommitEvery:     20,
			CommitInterval:  50 * time.Millisecond,
			DeadLetterTopic: dlq,
			Telemetry: consumer.Telemetry{
				Logger: testLogger(t),
				OnOutcome: func(_ context.Context, rep consumer.Report) {
					r := rep.Result
					if r.Action == consumer.ActionAck && !r.Duplicate {
						total.Add(1)
						perMember[i].Add(1)
					}
				},
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		return c, run(t, c)
	}
	progress := func(at int64, what string) {
		t.Helper()
		eventually(t, 60*time.Second, what, func() bool { return total.Load() >= at })
		t.Logf("%s at %d effects", what, total.Load())
	}

	// handles waits until member i got partitions and handled a record:
	// the next join or leave then rebalances a group it is part of.
	handles := func(i int) {
		t.Helper()
		eventually(t, 60*time.Second, fmt.Sprintf("member %d to handle a record", i), func() bool { return perMember[i].Load() > 0 })
	}
	_, r1 := member(0)
	progress(300, "second member joins")
	_, r2 := member(1)
	progress(900, "third member joins")
	handles(1)
	_, r3 := member(2)
	progress(1500, "first member leaves")
	handles(2)
	r1.stop(t)
	progress(2100, "second member leaves")
	r2.stop(t)

	<-produced
	ends := k.ends(t, topic, partitions)
	eventually(t, 90*time.Second, "every record committed", func() bool {
		return fmt.Sprint(k.committed(t, group, topic, partitions)) == fmt.Sprint(ends)
	})
	r3.stop(t)

	var dupIDs, distinct, rows int
	if err := setup.QueryRow(ctx, "SELECT count(*) FROM (SELECT id FROM "+effects+" GROUP BY id HAVING count(*) > 1) d").Scan(&dupIDs); err != nil {
		t.Fatal(err)
	}
	if err := setup.QueryRow(ctx, "SELECT count(DISTINCT id), count(*) FROM "+effects).Scan(&distinct, &rows); err != nil {
		t.Fatal(err)
	}
	t.Logf("rebalance: %d ids, %d effect rows, %d ids applied twice, %d lost; per member %d/%d/%d",
		n, rows, dupIDs, n-distinct, perMember[0].Load(), perMember[1].Load(), perMember[2].Load())
	if dupIDs != 0 || distinct != n || rows != n {
		t.Fatalf("%d ids applied more than once, %d of %d applied", dupIDs, distinct, n)
	}
	for i := range perMember {
		if perMember[i].Load() == 0 {
			t.Errorf("member %d handled nothing: no rebalance happened", i)
		}
	}
}

// TestOffsetsInPostgresReachKafka: with the positions in PostgreSQL, a
// member whose last Kafka commit is refused (it was expelled from the group
// while it committed) leaves Kafka's committed offsets behind the positions
// PostgreSQL holds. The next owner commits those positions to Kafka when
// the partitions are assigned to it, without waiting for new records: lag
// tools then show no lag on partitions that are fully processed.
func TestOffsetsInPostgresReachKafka(t *testing.T) {
	k := newKafka(t)
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	claims, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	offsets, err := kafkapg.NewOffsets(pool, kafkapg.OffsetsOptions{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(claims.Migrate(ctx), offsets.Migrate(ctx)); err != nil {
		t.Fatal(err)
	}
	const partitions, perPartition = 3, 10
	topic := k.topic(t, "pgkafka", partitions)
	dlq := k.dlq(t, topic)
	group := testenv.Name("g")
	var recs []kafkago.Message
	for i, id := range ids("p", partitions*perPartition) {
		recs = append(recs, rec(i%partitions, id, id, "v"))
	}
	k.produce(t, topic, recs...)
	h, err := kafkapg.Transactional(claims, offsets, consumer.TxOptions{Scope: "test/pgkafka"},
		func(context.Context, pgx.Tx, *consumer.Message) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	cfg := k.readerConfig(group, topic)
	// Short timeouts: the blocked member below is expelled when its
	// session or the rebalance times out.
	cfg.SessionTimeout, cfg.RebalanceTimeout, cfg.HeartbeatInterval = time.Second, 2*time.Second, 100*time.Millisecond
	var acked atomic.Int64
	opts := idemkafka.ConsumerOptions{
		Offsets:         offsets,
		DeadLetterTopic: dlq,
		// No Kafka commit while records are handled: only the
		// PostgreSQL positions move (in the handler's transaction).
		CommitEvery:    1 << 20,
		CommitInterval: time.Hour,
		Telemetry: consumer.Telemetry{
			Logger: testLogger(t),
			OnOutcome: func(_ context.Context, rep consumer.Report) {
				r := rep.Result
				if r.Action == consumer.ActionAck {
					acked.Add(1)
				}
			},
		},
	}
	a, err := idemkafka.NewConsumer(cfg, h, opts)
	if err != nil {
		t.Fatal(err)
	}
	// A's commit at the end of its generation waits until the group has
	// gone on without A: Kafka then refuses it.
	finalCommit, release := make(chan struct{}), make(chan struct{})
	var blockOnce, releaseOnce sync.Once
	idemkafka.SetCommitHooks(a, func(offs map[string]map[int]int64) {
		for _, off := range offs[topic] {
			if off > 0 {
				blockOnce.Do(func() {
					close(finalCommit)
					<-release
				})
				return
			}
		}
	}, nil)
	ra := run(t, a)
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) }) // before ra's stop

	pgPositions := func() []int64 {
		got, err := offsets.LoadOffsets(ctx, group, topic, []int{0, 1, 2})
		if err != nil {
			t.Fatal(err)
		}
		out := make([]int64, partitions)
		for p := range out {
			out[p] = got[p]
		}
		return out
	}
	eventually(t, 30*time.Second, "every record handled", func() bool { return acked.Load() == partitions*perPartition })
	want := fmt.Sprint([]int64{perPartition, perPartition, perPartition})
	if got := fmt.Sprint(pgPositions()); got != want {
		t.Fatalf("PostgreSQL positions %s, want %s", got, want)
	}

	opts.OnOutcome = nil
	b, err := idemkafka.NewConsumer(cfg, h, opts)
	if err != nil {
		t.Fatal(err)
	}
	run(t, b)
	<-finalCommit
	eventually(t, 30*time.Second, "the group to go on with B alone", func() bool {
		res, err := k.client.DescribeGroups(ctx, &kafkago.DescribeGroupsRequest{GroupIDs: []string{group}})
		return err == nil && len(res.Groups) == 1 && res.Groups[0].GroupState == "Stable" && len(res.Groups[0].Members) == 1
	})
	ra.cancel()
	releaseOnce.Do(func() { close(release) })
	ra.stop(t)

	eventually(t, 30*time.Second, "Kafka's committed offsets to reach the PostgreSQL positions "+want, func() bool {
		return fmt.Sprint(k.committed(t, group, topic, partitions)) == want
	})
	if got := fmt.Sprint(pgPositions()); got != want {
		t.Fatalf("PostgreSQL positions %s, want %s", got, want)
	}
}
