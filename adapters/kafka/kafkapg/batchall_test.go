package kafkapg_test

import (
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
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/adapters/kafka/kafkapg"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/kafkatest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// allEnv is a pgtable store and an effects table without a unique
// constraint in a fresh schema, and a BatchAll handler body that writes the
// effects of a batch with one unnest INSERT.
type allEnv struct {
	pool    *pgxpool.Pool
	schema  string
	claims  *pgtable.Store
	effects string
}

func newAllEnv(t *testing.T) *allEnv {
	t.Helper()
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	claims, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := claims.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+effects+" (id text NOT NULL, payload bytea)"); err != nil {
		t.Fatal(err)
	}
	return &allEnv{pool: pool, schema: schema, claims: claims, effects: effects}
}

// insertAll writes msgs' effects in one statement.
func (e *allEnv) insertAll(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
	ids, payloads := make([]string, len(msgs)), make([][]byte, len(msgs))
	for i, m := range msgs {
		ids[i], payloads[i] = m.ID, m.Payload
	}
	_, err := tx.Exec(ctx, "INSERT INTO "+e.effects+" (id, payload) SELECT * FROM unnest($1::text[], $2::bytea[])", ids, payloads)
	return err
}

// oracle fails the test when an effect was written twice, or when an
// acknowledged id has no effect or an effect has no acknowledged id.
func (e *allEnv) oracle(t *testing.T, acked []string) {
	t.Helper()
	ctx := context.Background()
	rows, err := e.pool.Query(ctx, "SELECT id FROM "+e.effects+" GROUP BY id HAVING count(*) > 1")
	if err != nil {
		t.Fatal(err)
	}
	twice, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(twice) > 0 {
		t.Errorf("effects written more than once: %v", twice)
	}
	rows, err = e.pool.Query(ctx, "SELECT DISTINCT id FROM "+e.effects+" ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := slices.Clone(acked)
	slices.Sort(want)
	want = slices.Compact(want)
	if !slices.Equal(got, want) {
		t.Errorf("effects of %v, want the acknowledged %v", got, want)
	}
}

// claimed returns the number of rows of the claims table.
func (e *allEnv) claimed(t *testing.T) (n int) {
	t.Helper()
	if err := e.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+e.claims.Table()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func idsOf(msgs []*consumer.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.ID
	}
	return out
}

// BatchAll's handler writes a batch's effects in one statement. A batch
// whose handler failed after its write, and the same batch delivered again,
// leave every acknowledged record's effect once.
func TestBatchAllOracle(t *testing.T) {
	e := newAllEnv(t)
	ctx := context.Background()
	errCrash := errors.New("crash after the write")
	var calls [][]string
	crashed := false
	bh, err := kafkapg.BatchAll(e.pool, e.claims, kafkapg.BatchOptions{Scope: "test/batch-all"},
		func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
			calls = append(calls, idsOf(msgs))
			if err := e.insertAll(ctx, tx, msgs); err != nil {
				return err
			}
			if !crashed {
				crashed = true
				return errCrash
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	var batch []*consumer.Message
	for i := range 20 {
		batch = append(batch, &consumer.Message{ID: fmt.Sprintf("m-%02d", i), Payload: []byte(fmt.Sprint(i))})
	}
	var acked []string
	deliver := func() {
		t.Helper()
		err := bh(ctx, batch)
		var be *idemkafka.BatchError
		switch {
		case err == nil:
			acked = append(acked, idsOf(batch)...)
		case errors.As(err, &be):
			for i, m := range batch {
				if be.Errs[i] == nil || errors.Is(be.Errs[i], dedup.ErrDuplicate) {
					acked = append(acked, m.ID)
				}
			}
		case !errors.Is(err, errCrash):
			t.Fatalf("batch handler = %v", err)
		}
	}
	deliver() // the handler fails after its write: nothing commits
	if n := e.claimed(t); n != 0 {
		t.Fatalf("%d claims after a failed batch, want 0", n)
	}
	e.oracle(t, nil)
	deliver() // the batch again, as the Consumer redelivers it
	deliver() // and once more: every record is a duplicate
	if len(calls) != 2 || !slices.Equal(calls[0], idsOf(batch)) || !slices.Equal(calls[1], idsOf(batch)) {
		t.Fatalf("handler calls %v, want the whole batch twice (failed, then committed) and no call for the duplicates", calls)
	}
	if len(acked) != 2*len(batch) {
		t.Fatalf("%d acknowledged, want %d", len(acked), 2*len(batch))
	}
	e.oracle(t, acked)
}

// Duplicates (from an earlier batch and within the batch), fingerprint
// mismatches and invalid keys (from KeyFunc or from the store) never reach
// BatchAll's handler, and each message's outcome is reported once.
func TestBatchAllLeavesOut(t *testing.T) {
	e := newAllEnv(t)
	ctx := context.Background()
	var calls [][]string
	var outcomes []string
	bh, err := kafkapg.BatchAll(e.pool, e.claims, kafkapg.BatchOptions{
		Scope: "test/batch-all",
		KeyFunc: func(m *consumer.Message) (string, error) {
			if string(m.Payload) == "no key" {
				return "", errors.New("no key")
			}
			return m.ID, nil
		},
		Telemetry: consumer.Telemetry{OnOutcome: func(_ context.Context, r consumer.Report) {
			outcomes = append(outcomes, r.Message.ID+":"+string(r.Outcome))
		}},
	}, func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
		calls = append(calls, idsOf(msgs))
		return e.insertAll(ctx, tx, msgs)
	})
	if err != nil {
		t.Fatal(err)
	}
	msg := func(id, payload string) *consumer.Message { return &consumer.Message{ID: id, Payload: []byte(payload)} }
	if err := bh(ctx, []*consumer.Message{msg("a", "1"), msg("b", "2")}); err != nil {
		t.Fatal(err)
	}
	err = bh(ctx, []*consumer.Message{
		msg("a", "1"),      // 0: duplicate of the first batch
		msg("c", "3"),      // 1: new
		msg("c", "3"),      // 2: duplicate within the batch
		msg("b", "other"),  // 3: fingerprint mismatch
		msg("x", "no key"), // 4: KeyFunc fails
		msg("", "5"),       // 5: the store rejects an empty id
		msg("d", "4"),      // 6: new
	})
	var be *idemkafka.BatchError
	if !errors.As(err, &be) {
		t.Fatalf("batch handler = %v; want a BatchError", err)
	}
	if !errors.Is(be.Errs[0], dedup.ErrDuplicate) || be.Errs[1] != nil || !errors.Is(be.Errs[2], dedup.ErrDuplicate) ||
		!errors.Is(be.Errs[3], dedup.ErrFingerprintMismatch) || be.Errs[4] == nil ||
		!errors.Is(be.Errs[5], dedup.ErrInvalidKey) || be.Errs[6] != nil {
		t.Fatalf("per-message errors %v", be.Errs)
	}
	if want := [][]string{{"a", "b"}, {"c", "d"}}; fmt.Sprint(calls) != fmt.Sprint(want) {
		t.Fatalf("handler calls %v, want %v", calls, want)
	}
	// Nothing new: the transaction holds no handler call.
	err = bh(ctx, []*consumer.Message{msg("a", "1"), msg("d", "4")})
	if !errors.As(err, &be) || !errors.Is(be.Errs[0], dedup.ErrDuplicate) || !errors.Is(be.Errs[1], dedup.ErrDuplicate) {
		t.Fatalf("batch of duplicates = %v", err)
	}
	if len(calls) != 2 {
		t.Fatalf("handler called for a batch of duplicates: %v", calls)
	}
	want := "a:completed b:completed a:duplicate c:completed c:duplicate b:fingerprint_mismatch :invalid_key d:completed a:duplicate d:duplicate"
	if got := strings.Join(outcomes, " "); got != want {
		t.Errorf("outcomes %q, want %q", got, want)
	}
	e.oracle(t, []string{"a", "b", "c", "d"})
}

// A failing BatchAll handler rolls back the claims and the effects of the
// batch together; its error keeps its verdict (a permanent error is
// dead-lettered, any other retried), and the records are new again.
func TestBatchAllRollback(t *testing.T) {
	e := newAllEnv(t)
	ctx := context.Background()
	errBoom := errors.New("boom")
	var fail error
	var calls [][]string
	bh, err := kafkapg.BatchAll(e.pool, e.claims, kafkapg.BatchOptions{Scope: "test/batch-all"},
		func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
			calls = append(calls, idsOf(msgs))
			if err := e.insertAll(ctx, tx, msgs); err != nil {
				return err
			}
			return fail
		})
	if err != nil {
		t.Fatal(err)
	}
	batch := []*consumer.Message{{ID: "a", Payload: []byte("1")}, {ID: "b", Payload: []byte("2")}}
	for _, c := range []struct {
		err    error
		action consumer.Action
	}{
		{errBoom, consumer.ActionRetry},
		{consumer.Permanent(errBoom), consumer.ActionDeadLetter},
	} {
		fail = c.err
		err := bh(ctx, batch)
		if !errors.Is(err, errBoom) {
			t.Fatalf("batch handler = %v; want errBoom", err)
		}
		if got := consumer.Decide(err).Action; got != c.action {
			t.Errorf("verdict of %v = %v, want %v", err, got, c.action)
		}
		if n := e.claimed(t); n != 0 {
			t.Fatalf("%d claims after a failed batch, want 0", n)
		}
		e.oracle(t, nil)
	}
	fail = nil
	if err := bh(ctx, batch); err != nil {
		t.Fatal(err)
	}
	if want := "[[a b] [a b] [a b]]"; fmt.Sprint(calls) != want {
		t.Fatalf("handler calls %v, want %s", calls, want)
	}
	if n := e.claimed(t); n != 2 {
		t.Fatalf("%d claims, want 2", n)
	}
	e.oracle(t, []string{"a", "b"})
}

// Under a BatchConsumer with the positions in PostgreSQL: records
// redelivered (a producer's retry, a second group reading the topic again)
// and a handler that fails once after its write leave each acknowledged
// record's effect exactly once, and the stored positions reach the end of
// each partition.
func TestBatchAllConsumer(t *testing.T) {
	e := newAllEnv(t)
	k := kafkatest.New(t)
	ctx := context.Background()
	offsets, err := kafkapg.NewOffsets(e.pool, kafkapg.OffsetsOptions{Schema: e.schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := offsets.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	const partitions, unique, again = 2, 60, 20
	topic := k.Topic(t, "batchall", partitions)
	dlq := topic + "_dlq"
	k.CreateTopic(t, dlq, 1)
	rec := func(p int, id, value string) kafkago.Message {
		m := kafkago.Message{Partition: p, Key: []byte(id), Value: []byte(value)}
		if id != "" {
			m.Headers = []kafkago.Header{{Key: outbox.HeaderMessageID, Value: []byte(id)}}
		}
		return m
	}
	var recs []kafkago.Message
	for i := range unique {
		recs = append(recs, rec(i%partitions, fmt.Sprintf("m-%03d", i), "v"))
	}
	for i := range again { // a producer's retries
		recs = append(recs, rec(i%partitions, fmt.Sprintf("m-%03d", i), "v"))
	}
	recs = append(recs, rec(0, "", "no id"), rec(1, "m-001", "other content"))
	perPartition := make([]int64, partitions)
	for _, r := range recs {
		perPartition[r.Partition]++
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

	var (
		mu      sync.Mutex
		calls   int
		batched bool // a call got more than one record
		bad     []string
		crashed bool
	)
	bh, err := kafkapg.BatchAll(e.pool, e.claims, kafkapg.BatchOptions{Scope: "test/batch-all", Offsets: offsets},
		func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
			mu.Lock()
			calls++
			batched = batched || len(msgs) > 1
			for _, m := range msgs {
				if m.ID == "" || string(m.Payload) != "v" {
					bad = append(bad, fmt.Sprintf("%q:%q", m.ID, m.Payload))
				}
			}
			crash := !crashed && len(msgs) > 1
			crashed = crashed || crash
			mu.Unlock()
			if err := e.insertAll(ctx, tx, msgs); err != nil {
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
	consume := func(group string) (acked []string, deadLettered int) {
		t.Helper()
		var (
			omu  sync.Mutex
			done atomic.Int64
		)
		c, err := idemkafka.NewBatchConsumer(kafkago.ReaderConfig{
			Brokers: k.Brokers, GroupID: group, Topic: topic,
			HeartbeatInterval: 100 * time.Millisecond, SessionTimeout: 10 * time.Second, RebalanceTimeout: 20 * time.Second,
			JoinGroupBackoff: 100 * time.Millisecond, MaxWait: 100 * time.Millisecond,
			ReadBackoffMin: 10 * time.Millisecond, ReadBackoffMax: 100 * time.Millisecond,
		}, bh, idemkafka.ConsumerOptions{
			Offsets: offsets, DeadLetterTopic: dlq, CommitEvery: 10, CommitInterval: 50 * time.Millisecond,
			Telemetry: consumer.Telemetry{
				OnOutcome: func(_ context.Context, r consumer.Report) {
					omu.Lock()
					defer omu.Unlock()
					switch r.Result.Action {
					case consumer.ActionAck:
						acked = append(acked, r.Message.ID)
					case consumer.ActionDeadLetter:
						deadLettered++
					default:
						return
					}
					done.Add(1)
				},
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		rctx, stop := context.WithCancel(ctx)
		errc := make(chan error, 1)
		go func() { errc <- c.Run(rctx) }()
		testenv.Eventually(t, 60*time.Second, "every record of "+group+" done", func() bool { return done.Load() == int64(len(recs)) })
		testenv.Eventually(t, 30*time.Second, "the positions of "+group+" at the end of the partitions", func() bool {
			got, err := offsets.LoadOffsets(ctx, group, topic, []int{0, 1})
			return err == nil && got[0] == perPartition[0] && got[1] == perPartition[1]
		})
		stop()
		if err := <-errc; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("Run: %v", err)
		}
		omu.Lock()
		defer omu.Unlock()
		return acked, deadLettered
	}

	acked, dl := consume(testenv.Name("g"))
	if dl != 2 {
		t.Errorf("%d dead-lettered, want 2 (no id, other content)", dl)
	}
	if len(acked) != unique+again {
		t.Errorf("%d acknowledged, want %d", len(acked), unique+again)
	}
	mu.Lock()
	if !crashed || !batched {
		t.Errorf("no batch of several records reached the handler (crashed %v, batched %v)", crashed, batched)
	}
	if len(bad) > 0 {
		t.Errorf("the handler got records that are not new: %v", bad)
	}
	first := calls
	mu.Unlock()
	e.oracle(t, acked)

	// Another group reads the topic again: every record is a duplicate.
	acked2, dl2 := consume(testenv.Name("g"))
	if dl2 != 2 || len(acked2) != unique+again {
		t.Errorf("the second group acknowledged %d and dead-lettered %d, want %d and 2", len(acked2), dl2, unique+again)
	}
	mu.Lock()
	if calls != first {
		t.Errorf("the handler ran %d times for the second group, want 0", calls-first)
	}
	mu.Unlock()
	e.oracle(t, append(acked, acked2...))
}
