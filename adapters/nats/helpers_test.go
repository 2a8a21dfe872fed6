package idemnats

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// testStream is a test's work stream, storing "<name>.work.>", deleted
// with its dead-letter stream when the test ends.
type testStream struct {
	js   jetstream.JetStream
	name string
}

// newStream creates a work stream with duplicate window dup (JetStream's
// default of 2 minutes when zero).
func newStream(t testing.TB, js jetstream.JetStream, dup time.Duration) *testStream {
	t.Helper()
	name := strings.ReplaceAll(testenv.UniqueID("idemtest"), "-", "_")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".work.>"}, Duplicates: dup, Storage: jetstream.FileStorage}); err != nil {
		t.Fatalf("create stream %s: %v", name, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, name)
		_ = js.DeleteStream(ctx, name+"-dlq")
	})
	return &testStream{js: js, name: name}
}

func (s *testStream) subject() string { return s.name + ".work.x" }

// publish publishes payload with Nats-Msg-Id id (none when id is empty)
// and returns the PubAck.
func (s *testStream) publish(t testing.TB, id string, payload []byte, hdr nats.Header) *jetstream.PubAck {
	t.Helper()
	m := &nats.Msg{Subject: s.subject(), Data: payload, Header: nats.Header{}}
	for k, v := range hdr {
		m.Header[k] = v
	}
	if id != "" {
		m.Header.Set(nats.MsgIdHdr, id)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ack, err := s.js.PublishMsg(ctx, m)
	if err != nil {
		t.Fatalf("publish %s: %v", id, err)
	}
	return ack
}

// publishN publishes ids prefix-0 ... prefix-(n-1) with payload "p-<id>"
// and returns them.
func (s *testStream) publishN(t testing.TB, prefix string, n int) []string {
	t.Helper()
	ids := make([]string, n)
	for i := range n {
		ids[i] = fmt.Sprintf("%s-%d", prefix, i)
		s.publish(t, ids[i], []byte("p-"+ids[i]), nil)
	}
	return ids
}

// deadLetters reads every message of the dead-letter stream.
func (s *testStream) deadLetters(t testing.TB) []jetstream.Msg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := s.js.Stream(ctx, s.name+"-dlq")
	if err != nil {
		t.Fatalf("dead-letter stream: %v", err)
	}
	return readAll(t, st)
}

// readAll reads every message of st through an ephemeral consumer.
func readAll(t testing.TB, st jetstream.Stream) []jetstream.Msg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := int(info.State.Msgs)
	if want == 0 {
		return nil
	}
	c, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var out []jetstream.Msg
	for len(out) < want {
		b, err := c.Fetch(want-len(out), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for m := range b.Messages() {
			out = append(out, m)
			n++
		}
		if n == 0 {
			t.Fatalf("read %d of %d messages of %s", len(out), want, info.Config.Name)
		}
	}
	return out
}

// pending is the durable consumer's count of messages not yet settled:
// delivered and unacknowledged, or not yet delivered.
func pending(t testing.TB, js jetstream.JetStream, stream, durable string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := js.Consumer(ctx, stream, durable)
	if err != nil {
		t.Fatal(err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return int(info.NumPending) + info.NumAckPending
}

// oracle is a PostgreSQL schema with the pgtable store and an effects
// table without any unique constraint: every applied effect is a row, so a
// duplicate effect shows as a second row.
type oracle struct {
	pool   *pgxpool.Pool
	schema string
	store  *pgtable.Store
}

func newOracle(t testing.TB, maxConns int32) *oracle {
	t.Helper()
	pool := testenv.Pool(t, maxConns)
	schema := testenv.Schema(t, pool)
	o, err := openOracle(pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := o.store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+o.table()+" (id text NOT NULL, attempt int NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return o
}

func openOracle(pool *pgxpool.Pool, schema string) (*oracle, error) {
	store, err := pgtable.New(pool, pgtable.Options{Schema: schema, Logger: quiet()})
	if err != nil {
		return nil, err
	}
	return &oracle{pool: pool, schema: schema, store: store}, nil
}

func (o *oracle) table() string { return pgx.Identifier{o.schema, "effects"}.Sanitize() }

// txHandler is the Transactional handler that applies the effect, after
// before (if set) ran inside the transaction and before after (if set)
// runs, still inside it.
func (o *oracle) txHandler(before, after func(ctx context.Context, msg *consumer.Message) error) (consumer.Handler, error) {
	ins := "INSERT INTO " + o.table() + " (id, attempt) VALUES ($1, $2)"
	return consumer.Transactional(o.store, consumer.TxOptions{Scope: "test/effects"},
		func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			if before != nil {
				if err := before(ctx, msg); err != nil {
					return err
				}
			}
			if _, err := tx.Exec(ctx, ins, msg.ID, msg.Attempt); err != nil {
				return err
			}
			if after != nil {
				return after(ctx, msg)
			}
			return nil
		})
}

func (o *oracle) handler(t testing.TB, before func(ctx context.Context, msg *consumer.Message) error) consumer.Handler {
	t.Helper()
	h, err := o.txHandler(before, nil)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// counts returns the number of effect rows and of distinct ids.
func (o *oracle) counts(t testing.TB) (rows, distinct int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := o.pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT id) FROM "+o.table()).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	return rows, distinct
}

// check fails the test unless every id in want has exactly one effect
// row and no other id has any.
func (o *oracle) check(t testing.TB, want []string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rows, err := o.pool.Query(ctx, "SELECT id, count(*) FROM "+o.table()+" GROUP BY id")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			t.Fatal(err)
		}
		got[id] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	dups, lost := 0, 0
	for _, id := range want {
		switch n := got[id]; {
		case n == 0:
			lost++
		case n > 1:
			dups += n - 1
		}
		delete(got, id)
	}
	if dups > 0 || lost > 0 || len(got) > 0 {
		t.Errorf("%d ids: %d duplicate effects, %d lost, %d unexpected ids", len(want), dups, lost, len(got))
	}
}

// runConsumer runs c until the test ends (or stop is called) and waits
// for Ready.
func runConsumer(t testing.TB, c *Consumer) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- c.Run(ctx) }()
	select {
	case <-c.Ready():
	case err := <-errc:
		cancel()
		t.Fatalf("Run returned before Ready: %v", err)
	case <-time.After(30 * time.Second):
		cancel()
		t.Fatal("the consumer was not ready within 30s")
	}
	var err error
	stopped := false
	stop = func() error {
		if !stopped {
			stopped = true
			cancel()
			err = <-errc
		}
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// testBackoff gives short retry delays for tests: 20ms, 40ms, then 50ms.
var testBackoff = consumer.Backoff{Initial: 20 * time.Millisecond, Max: 50 * time.Millisecond}
