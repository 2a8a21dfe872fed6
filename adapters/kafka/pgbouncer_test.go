package idemkafka_test

import (
	"context"
	"errors"
	"fmt"
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
	"github.com/idemkit/idem/internal/testkit/pgbouncer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestPgBouncerOffsetsInPostgres: the claims and the positions
// (kafkapg.Offsets) through PgBouncer in transaction mode, its 4 server
// connections shared by three members of a group that join and leave
// while records, one in ten of them published twice, are handled with
// kafkapg.Transactional. No effect applied twice, none lost, and the
// positions in PostgreSQL reach the end of every partition.
func TestPgBouncerOffsetsInPostgres(t *testing.T) {
	k := newKafka(t)
	direct := testenv.Pool(t, 2)
	b := pgbouncer.New(t, pgbouncer.Options{})
	schema := testenv.Schema(t, direct)
	ctx := context.Background()
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := direct.Exec(ctx, "CREATE TABLE "+effects+" (id text NOT NULL, member integer NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	stores := func() (*pgtable.Store, *kafkapg.Offsets) {
		pool := b.Pool(t, 4)
		claims, err := pgtable.New(pool, pgtable.Options{Schema: schema})
		if err != nil {
			t.Fatal(err)
		}
		offsets, err := kafkapg.NewOffsets(pool, kafkapg.OffsetsOptions{Schema: schema})
		if err != nil {
			t.Fatal(err)
		}
		return claims, offsets
	}
	// Three processes migrate at once.
	var wg sync.WaitGroup
	migrateErrs := make(chan error, 3)
	for range 3 {
		claims, offsets := stores()
		wg.Go(func() { migrateErrs <- errors.Join(claims.Migrate(ctx), offsets.Migrate(ctx)) })
	}
	wg.Wait()
	close(migrateErrs)
	for err := range migrateErrs {
		if err != nil {
			t.Fatalf("Migrate through PgBouncer: %v", err)
		}
	}

	const partitions, n = 4, 1200
	topic := k.topic(t, "pgbouncer", partitions)
	dlq := k.dlq(t, topic)
	group := testenv.Name("g")
	all := ids("b", n)
	produced := make(chan struct{})
	go func() {
		defer close(produced)
		w := k.writer(t, topic)
		for c := range n / 100 {
			var recs []kafkago.Message
			for i := c * 100; i < (c+1)*100; i++ {
				recs = append(recs, rec(i%partitions, all[i], all[i], "payload-"+all[i]))
				if i%10 == 0 { // the producer's retry
					recs = append(recs, rec(i%partitions, all[i], all[i], "payload-"+all[i]))
				}
			}
			if err := w.WriteMessages(ctx, recs...); err != nil {
				t.Errorf("produce: %v", err)
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()

	var total atomic.Int64
	perMember := make([]atomic.Int64, 3)
	var lastOffsets *kafkapg.Offsets
	member := func(i int) *running {
		claims, offsets := stores()
		lastOffsets = offsets
		h, err := kafkapg.Transactional(claims, offsets, consumer.TxOptions{Scope: "test/pgbouncer"},
			func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
				_, err := tx.Exec(ctx, "INSERT INTO "+effects+" (id, member) VALUES ($1, $2)", msg.ID, i)
				return err
			})
		if err != nil {
			t.Fatal(err)
		}
		c, err := idemkafka.NewConsumer(k.readerConfig(group, topic), h, idemkafka.ConsumerOptions{
			Offsets: offsets, CommitEvery: 20, CommitInterval: 50 * time.Millisecond, DeadLetterTopic: dlq,
			Telemetry: consumer.Telemetry{
				Logger: testLogger(t),
				OnOutcome: func(_ context.Context, rep consumer.Report) {
					if r := rep.Result; r.Action == consumer.ActionAck && !r.Duplicate {
						total.Add(1)
						perMember[i].Add(1)
					}
				},
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		return run(t, c)
	}
	progress := func(at int64, what string) {
		t.Helper()
		eventually(t, 60*time.Second, what, func() bool { return total.Load() >= at })
	}
	handles := func(i int) {
		t.Helper()
		eventually(t, 60*time.Second, fmt.Sprintf("member %d to handle a record", i), func() bool { return perMember[i].Load() > 0 })
	}
	r1 := member(0)
	progress(200, "second member joins")
	r2 := member(1)
	progress(500, "third member joins")
	handles(1)
	r3 := member(2)
	progress(800, "first member leaves")
	handles(2)
	r1.stop(t)
	<-produced
	ends := k.ends(t, topic, partitions)
	parts := make([]int, partitions)
	for p := range parts {
		parts[p] = p
	}
	eventually(t, 90*time.Second, "the positions in PostgreSQL at the end of every partition", func() bool {
		got, err := lastOffsets.LoadOffsets(ctx, group, topic, parts)
		if err != nil {
			return false
		}
		for p, end := range ends {
			if got[p] != end {
				return false
			}
		}
		return true
	})
	r2.stop(t)
	r3.stop(t)

	var dupIDs, distinct, rows int
	if err := direct.QueryRow(ctx, "SELECT count(*) FROM (SELECT id FROM "+effects+" GROUP BY id HAVING count(*) > 1) d").Scan(&dupIDs); err != nil {
		t.Fatal(err)
	}
	if err := direct.QueryRow(ctx, "SELECT count(DISTINCT id), count(*) FROM "+effects).Scan(&distinct, &rows); err != nil {
		t.Fatal(err)
	}
	t.Logf("oracle: %d ids (%d records), %d effect rows, %d ids applied twice, %d lost; per member %d/%d/%d",
		n, n+n/10, rows, dupIDs, n-distinct, perMember[0].Load(), perMember[1].Load(), perMember[2].Load())
	if dupIDs != 0 || distinct != n || rows != n {
		t.Fatalf("%d ids applied more than once, %d of %d applied", dupIDs, distinct, n)
	}
}
