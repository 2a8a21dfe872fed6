package kafka_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"

	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testenv"
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
	member := func(i int) (*kafka.Consumer, *running) {
		pool := testenv.Pool(t, 4)
		store, err := pgtable.New(pool, pgtable.Options{Schema: schema})
		if err != nil {
			t.Fatal(err)
		}
		h, err := consumer.Transactional(store, consumer.TxOptions{Scope: "test/rebalance"},
			func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
				p, _ := strconv.Atoi(msg.Metadata[kafka.MetadataPartition])
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
		c, err := kafka.NewConsumer(k.readerConfig(group, topic), h, kafka.Options{
			CommitEvery:     20,
			CommitInterval:  50 * time.Millisecond,
			DeadLetterTopic: dlq,
			Logger:          testLogger(t),
			OnResult: func(_ context.Context, _ *consumer.Message, r consumer.Result) {
				if r.Action == consumer.ActionAck && !r.Duplicate {
					total.Add(1)
					perMember[i].Add(1)
				}
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
