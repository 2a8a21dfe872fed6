package pgoutbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/pgbouncer"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// The outbox through PgBouncer in transaction mode: Enqueue, Migrate,
// Cleanup and the backlog run on a pool through it; the relay's sessions,
// which hold session-level advisory locks and LISTEN, need a direct
// connection (RelayOptions.ConnConfig) and refuse a pooled one.

// directConfig is a connection configuration straight to the test database.
func directConfig(t testing.TB) *pgx.ConnConfig {
	t.Helper()
	cfg, err := pgx.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// relayLocks counts the advisory locks held in ob's relay namespace.
func relayLocks(t testing.TB, direct *pgxpool.Pool, ob *pgoutbox.Outbox) int {
	t.Helper()
	var n int
	if err := direct.QueryRow(context.Background(),
		"SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid::bigint = $1",
		int64(pgoutbox.RelayNS(ob))).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Run refuses session connections through a transaction-mode pooler with
// an error naming RelayOptions.ConnConfig, before it took any lock there.
func TestPgBouncerRelayRefusesPooledSessions(t *testing.T) {
	direct := testenv.Pool(t, 2)
	b := pgbouncer.New(t, pgbouncer.Options{})
	pool := b.Pool(t, 4)
	ob := newOutbox(t, pool, pgoutbox.Options{Schema: testenv.Schema(t, direct)})
	enqueue(t, pool, ob, msg("t", "k", "x"))
	pub := &memPublisher{}
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = r.Run(ctx)
	if err == nil || ctx.Err() != nil {
		t.Fatalf("Run through PgBouncer = %v; want an error at once", err)
	}
	for _, want := range []string{"RelayOptions.ConnConfig", "session-level advisory locks", "LISTEN", "pool_mode=transaction", "RelayOptions.SessionPooler"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Run's error does not name %q: %v", want, err)
		}
	}
	if n := relayLocks(t, direct, ob); n != 0 {
		t.Fatalf("%d relay locks left on PgBouncer's server connections", n)
	}
	if got := pub.callCount(); got != 0 {
		t.Fatalf("the refused relay published %d batches", got)
	}
}

// A notification sent by Enqueue through PgBouncer wakes a relay whose
// session connection is direct: its poll and rebalance intervals are an
// hour.
func TestPgBouncerNotifyWakesDirectRelay(t *testing.T) {
	direct := testenv.Pool(t, 2)
	b := pgbouncer.New(t, pgbouncer.Options{})
	pool := b.Pool(t, 4)
	ob := newOutbox(t, pool, pgoutbox.Options{Schema: testenv.Schema(t, direct)})
	pub := &memPublisher{}
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{
		ConnConfig: directConfig(t), PollInterval: time.Hour, RebalanceInterval: time.Hour,
	}))
	if err != nil {
		t.Fatal(err)
	}
	idle := onIdle(r)
	start(t, r)
	waitIdle(t, idle)
	for i := range 3 {
		enqueue(t, pool, ob, msg("t", keyOf(i, 2), fmt.Sprint(i)))
		testenv.Eventually(t, 20*time.Second, "the message published on the notification", func() bool { return len(pub.published()) == i+1 })
	}
}

// The whole path through PgBouncer: producers enqueue through it, two
// relays (two sessions each, on direct connections) publish, and the
// publisher is the downstream consumer, claiming each message in pgtable
// through PgBouncer and writing its effect in the claim's transaction.
// One batch in five is reported failed after it was applied, so the relays
// publish it again: the oracle must find every message applied once, and
// each key's messages first applied in their enqueue order.
func TestPgBouncerOutboxEndToEnd(t *testing.T) {
	direct := testenv.Pool(t, 4)
	b := pgbouncer.New(t, pgbouncer.Options{})
	pool := b.Pool(t, 12)
	schema := testenv.Schema(t, direct)
	ob := newOutbox(t, pool, pgoutbox.Options{Schema: schema})
	eff := newEffects(t, direct, schema)
	store, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(testenv.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	h, err := consumer.Transactional(store, consumer.TxOptions{Scope: "pgbouncer/apply"},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+eff.table+" (msg_id, payload) VALUES ($1, $2)", m.ID, string(m.Payload))
			return err
		})
	if err != nil {
		t.Fatal(err)
	}
	var (
		deliveries, replays atomic.Int64
		batches             atomic.Int64
		orderMu             sync.Mutex
		firstApplied        = map[string][]string{} // key -> payloads in first-applied order
		applied             = map[string]bool{}
	)
	pub := publisherFunc(func(ctx context.Context, msgs []*outbox.Message) error {
		for _, m := range msgs {
			res := consumer.Process(ctx, h, &consumer.Message{ID: m.ID, Key: m.Key, Payload: m.Payload, Topic: m.Topic})
			if res.Action != consumer.ActionAck {
				return fmt.Errorf("message %s: %w", m.ID, res.Err)
			}
			deliveries.Add(1)
			orderMu.Lock()
			if !applied[m.ID] {
				applied[m.ID] = true
				firstApplied[string(m.Key)] = append(firstApplied[string(m.Key)], string(m.Payload))
			} else {
				replays.Add(1)
			}
			orderMu.Unlock()
		}
		if batches.Add(1)%5 == 0 {
			return errors.New("confirm lost") // applied, reported failed: the relay sends the batch again
		}
		return nil
	})
	for range 2 {
		r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{
			ConnConfig: directConfig(t), Sessions: 2, Shards: 8, BatchSize: 20,
		}))
		if err != nil {
			t.Fatal(err)
		}
		start(t, r)
	}

	const producers, perProducer, keys = 6, 100, 12
	var wg sync.WaitGroup
	errs := make(chan error, producers)
	for p := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := testenv.Ctx(t)
			for i := range perProducer {
				// Each key belongs to one producer, so its enqueue order is
				// the producer's loop order.
				key := fmt.Sprintf("p%d-k%d", p, i%(keys/producers))
				m := msg("t", key, fmt.Sprintf("%06d", i))
				if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					_, err := ob.Enqueue(ctx, tx, m)
					return err
				}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("enqueue through PgBouncer: %v", err)
	}
	total := producers * perProducer
	testenv.Eventually(t, 90*time.Second, "every message applied and marked", func() bool {
		pending, _, err := ob.Backlog(context.Background())
		return err == nil && pending == 0 && len(eff.counts(t)) == total
	})

	counts := eff.counts(t)
	dups := 0
	for _, n := range counts {
		if n > 1 {
			dups++
		}
	}
	if dups != 0 || len(counts) != total {
		t.Fatalf("oracle: %d messages, %d applied, %d applied more than once", total, len(counts), dups)
	}
	orderMu.Lock()
	defer orderMu.Unlock()
	for key, payloads := range firstApplied {
		for i := 1; i < len(payloads); i++ {
			if payloads[i] < payloads[i-1] {
				t.Fatalf("key %s: %s applied before %s", key, payloads[i-1], payloads[i])
			}
		}
	}
	if replays.Load() == 0 {
		t.Fatal("no message was published twice: the lost confirms did not happen")
	}
	t.Logf("oracle: %d messages, %d deliveries (%d replays after lost confirms), 0 applied twice, 0 lost, per-key order kept",
		total, deliveries.Load(), replays.Load())
}

// Through a pooler in session mode the relay runs with
// RelayOptions.SessionPooler, and refuses without it.
func TestPgBouncerSessionModeRelay(t *testing.T) {
	direct := testenv.Pool(t, 2)
	b := pgbouncer.New(t, pgbouncer.Options{PoolMode: pgbouncer.Session, PoolSize: 6})
	pool := b.Pool(t, 3)
	ob := newOutbox(t, pool, pgoutbox.Options{Schema: testenv.Schema(t, direct)})

	r, err := pgoutbox.NewRelay(ob, &memPublisher{}, fastRelay(pgoutbox.RelayOptions{}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := r.Run(ctx); err == nil || !strings.Contains(err.Error(), "RelayOptions.SessionPooler") {
		t.Fatalf("Run through a session-mode pooler without SessionPooler = %v; want the refusal", err)
	}

	pub := &memPublisher{}
	r, err = pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{SessionPooler: true, Sessions: 2}))
	if err != nil {
		t.Fatal(err)
	}
	start(t, r)
	var want []string
	for i := range 20 {
		want = append(want, enqueue(t, pool, ob, msg("t", keyOf(i, 4), fmt.Sprint(i)))...)
	}
	testenv.Eventually(t, 30*time.Second, "every message published", func() bool { return len(pub.publishedIDs()) == len(want) })
	got := pub.publishedIDs()
	for _, id := range want {
		if got[id] != 1 {
			t.Fatalf("message %s published %d times", id, got[id])
		}
	}
}

// publisherFunc adapts a function to outbox.Publisher.
type publisherFunc func(ctx context.Context, msgs []*outbox.Message) error

func (f publisherFunc) Publish(ctx context.Context, msgs []*outbox.Message) error {
	return f(ctx, msgs)
}
