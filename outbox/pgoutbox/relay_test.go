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

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

func TestNewValidates(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 2)
	for _, o := range []pgoutbox.Options{
		{Schema: "Bad"},
		{Table: "x; DROP TABLE y"},
		{Table: strings.Repeat("t", 51)},
		{Retention: -time.Second},
		{CleanupBatch: -1},
	} {
		if _, err := pgoutbox.New(pool, o); err == nil {
			t.Errorf("New(%+v) = nil error", o)
		}
	}
	noPool, err := pgoutbox.New(nil, pgoutbox.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := noPool.Migrate(context.Background()); err == nil {
		t.Error("Migrate without a pool = nil error")
	}
	if _, err := pgoutbox.NewRelay(noPool, &memPublisher{}, pgoutbox.RelayOptions{}); err == nil {
		t.Error("NewRelay without a pool = nil error")
	}
	ob, err := pgoutbox.New(pool, pgoutbox.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got := ob.Channel(); got != "idem_outbox.public.outbox" {
		t.Errorf("Channel() = %q", got)
	}
	for _, o := range []pgoutbox.RelayOptions{
		{Shards: 2000},
		{Shards: 4, Sessions: 5},
		{BatchSize: -1},
		{PollInterval: -time.Second},
		{Backoff: consumer.Backoff{Initial: time.Minute, Max: time.Second}},
		{Backoff: consumer.Backoff{Initial: time.Microsecond}},
		{ReconnectBackoff: consumer.Backoff{Factor: 0.5}},
		{Telemetry: consumer.Telemetry{OnOutcome: func(context.Context, consumer.Report) {}}},
		{BatchSize: 100, ScanWindow: 10},
	} {
		if _, err := pgoutbox.NewRelay(ob, &memPublisher{}, o); err == nil {
			t.Errorf("NewRelay(%+v) = nil error", o)
		}
	}
	if _, err := pgoutbox.NewRelay(ob, nil, pgoutbox.RelayOptions{}); err == nil {
		t.Error("NewRelay(nil publisher) = nil error")
	}
}

func TestMigrateConcurrentlyAndSQL(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	schema := testenv.Schema(t, pool)
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: schema, Table: "events_out"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Go(func() { errs <- ob.Migrate(ctx) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	got, err := ob.MigrationStatus(ctx)
	if err != nil || len(got) != 1 || got[0] != "0001_outbox" {
		t.Fatalf("MigrationStatus = %v, %v", got, err)
	}
	script, err := ob.SQL()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`CREATE SCHEMA IF NOT EXISTS "` + schema + `"`, `"` + schema + `"."events_out"`, `"events_out_pending_idx"`} {
		if !strings.Contains(script, want) {
			t.Errorf("SQL() lacks %s", want)
		}
	}
	// The printed script applies by hand, too.
	other := testenv.Schema(t, pool)
	ob2, _ := pgoutbox.New(pool, pgoutbox.Options{Schema: other})
	script2, _ := ob2.SQL()
	if _, err := pool.Exec(ctx, script2); err != nil {
		t.Fatalf("applying SQL(): %v", err)
	}
}

// Rows of a rolled-back transaction are never published; rows of a
// committed one always are.
func TestRolledBackNeverCommittedAlways(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	pub := &memPublisher{}
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{Shards: 4}))
	if err != nil {
		t.Fatal(err)
	}
	start(t, r)
	ctx := context.Background()

	var committed, rolledBack []string
	for i := range 50 {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		ids, err := ob.Enqueue(ctx, tx, msg("orders", keyOf(i, 7), fmt.Sprint("c", i)), msg("orders", "", fmt.Sprint("c-nokey", i)))
		if err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			committed = append(committed, ids...)
		} else {
			if err := tx.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			rolledBack = append(rolledBack, ids...)
		}
	}
	// A rolled-back transaction that held a key's lock does not block the
	// key, and its sequence numbers leave gaps the relay does not wait on.
	testenv.Eventually(t, 30*time.Second, "every committed message published and marked", func() bool {
		got := pub.publishedIDs()
		for _, id := range committed {
			if got[id] == 0 {
				return false
			}
		}
		return countState(t, pool, ob, 1) == len(committed)
	})
	got := pub.publishedIDs()
	for _, id := range rolledBack {
		if got[id] > 0 {
			t.Errorf("message %s of a rolled-back transaction was published", id)
		}
	}
	if n := countState(t, pool, ob, 1); n != len(committed) {
		t.Errorf("%d rows published, want %d", n, len(committed))
	}
	if n := countState(t, pool, ob, 0); n != 0 {
		t.Errorf("%d rows still pending", n)
	}
}

// Two transactions enqueue the same key; the one that enqueues first holds
// the key's lock, so the second takes its sequence number only after the
// first committed: sequence order is commit order.
func TestSameKeyEnqueuesSerializeUntilCommit(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	tx1, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx1.Rollback(ctx) }()
	ids1, err := ob.Enqueue(ctx, tx1, msg("t", "acct-1", "first"))
	if err != nil {
		t.Fatal(err)
	}
	var pid1 uint32
	if err := tx1.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid1); err != nil {
		t.Fatal(err)
	}

	second := make(chan []string, 1)
	secondErr := make(chan error, 1)
	go func() {
		var ids []string
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var err error
			ids, err = ob.Enqueue(ctx, tx, msg("t", "other-key", "x"), msg("t", "acct-1", "second"))
			return err
		})
		secondErr <- err
		second <- ids
	}()
	// The second transaction waits on the key's advisory lock, held by the
	// first.
	testenv.Eventually(t, 20*time.Second, "second Enqueue blocked on the key lock", func() bool {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks w JOIN pg_locks h
			ON h.locktype = 'advisory' AND w.locktype = 'advisory' AND h.objid = w.objid AND h.classid = w.classid
			WHERE NOT w.granted AND h.granted AND h.pid = $1`, pid1).Scan(&n)
		return err == nil && n > 0
	})
	select {
	case <-second:
		t.Fatal("second Enqueue returned while the first transaction holds the key")
	default:
	}
	if err := tx1.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-secondErr; err != nil {
		t.Fatal(err)
	}
	ids2 := <-second
	rows := rowsByID(t, pool, ob)
	if rows[ids1[0]].seq >= rows[ids2[1]].seq {
		t.Errorf("seq of the first commit %d >= seq of the second %d", rows[ids1[0]].seq, rows[ids2[1]].seq)
	}
}

func TestEnqueueIDsHeadersAndTrace(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	pub := &memPublisher{}
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{}))
	if err != nil {
		t.Fatal(err)
	}
	start(t, r)

	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	ctx := traceCtx(tp, "vendor=x")
	own := "0190a0b0-0000-7000-8000-000000000001"
	var ids []string
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		ids, err = ob.Enqueue(ctx, tx,
			outbox.Message{Topic: "t", Key: []byte("k"), Payload: []byte("a"), Headers: map[string]string{"x-app": "1"}},
			outbox.Message{ID: own, Topic: "t", Key: []byte("k"), Payload: []byte("b"), Headers: map[string]string{outbox.HeaderTraceParent: "mine"}},
		)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if ids[1] != own {
		t.Errorf("id of a message with its own ID = %s, want %s", ids[1], own)
	}
	testenv.Eventually(t, 20*time.Second, "2 messages published", func() bool { return len(pub.published()) == 2 })
	got := pub.published()
	if got[0].ID != ids[0] || got[1].ID != ids[1] {
		t.Fatalf("published %s, %s; want %v in order", got[0].ID, got[1].ID, ids)
	}
	if h := got[0].Headers; h[outbox.HeaderTraceParent] != tp || h[outbox.HeaderTraceState] != "vendor=x" || h["x-app"] != "1" {
		t.Errorf("headers of the first message = %v", h)
	}
	if h := got[1].Headers; h[outbox.HeaderTraceParent] != "mine" {
		t.Errorf("a message's own traceparent was overwritten: %v", h)
	}
	if got[0].Attempt != 1 || got[0].CreatedAt.IsZero() || string(got[0].Payload) != "a" || string(got[0].Key) != "k" {
		t.Errorf("first message = %+v", got[0])
	}

	for _, bad := range []outbox.Message{
		{ID: "not-a-uuid", Topic: "t"},
		{Topic: "t", Headers: map[string]string{"h": "nul\x00"}},
		{Topic: "t", Headers: map[string]string{"": "v"}},
	} {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := ob.Enqueue(ctx, tx, bad)
			return err
		})
		if err == nil {
			t.Errorf("Enqueue(%+v) = nil error", bad)
		}
	}
}

// A message whose publish always fails is retried with backoff and parked
// dead after MaxAttempts, while the other keys flow; the key's later
// messages wait until it is dead, then proceed.
func TestPoisonMessageEndsDeadWhileOthersFlow(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	pub := &memPublisher{fail: func(m *outbox.Message) error {
		if string(m.Payload) == "poison" {
			return fmt.Errorf("rejected: %w", errBoom)
		}
		return nil
	}}
	mp := telemetrytest.NewMetrics(t)
	const maxAttempts = 4
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{
		MaxAttempts: maxAttempts, Backoff: consumer.Backoff{Initial: 30 * time.Millisecond, Max: 100 * time.Millisecond},
		Telemetry: consumer.Telemetry{MeterProvider: mp}, MetricsInterval: 50 * time.Millisecond,
	}))
	if err != nil {
		t.Fatal(err)
	}
	var seenPoison atomic.Int32
	var afterPoisonBeforeDead atomic.Int32
	var poisonDead atomic.Bool
	pgoutbox.SetAfterPublish(r, func(msgs []*outbox.Message, _ error) {
		for _, x := range msgs {
			switch string(x.Payload) {
			case "poison":
				if int(seenPoison.Add(1)) == maxAttempts {
					poisonDead.Store(true)
				}
			case "after-poison":
				if !poisonDead.Load() {
					afterPoisonBeforeDead.Add(1)
				}
			}
		}
	})
	start(t, r)

	ids := enqueue(t, pool, ob, msg("t", "bad", "poison"), msg("t", "bad", "after-poison"))
	var others []string
	for i := range 200 {
		others = append(others, enqueue(t, pool, ob, msg("t", keyOf(i, 20), fmt.Sprint(i)))...)
	}
	testenv.Eventually(t, 30*time.Second, "the poison message dead and everything else published", func() bool {
		return countState(t, pool, ob, 2) == 1 && countState(t, pool, ob, 0) == 0
	})
	rows := rowsByID(t, pool, ob)
	poison := rows[ids[0]]
	if poison.state != 2 || poison.attempts != maxAttempts || poison.lastErr == nil || !strings.Contains(*poison.lastErr, "boom") {
		t.Errorf("poison row = %+v (last error %v), want dead after %d attempts", poison, deref(poison.lastErr), maxAttempts)
	}
	if got := seenPoison.Load(); got != maxAttempts {
		t.Errorf("poison message published %d times, want %d", got, maxAttempts)
	}
	if n := afterPoisonBeforeDead.Load(); n != 0 {
		t.Errorf("the key's next message was sent %d times before the poison one was dead", n)
	}
	if rows[ids[1]].state != 1 {
		t.Errorf("message after the poison one: state %d, want published", rows[ids[1]].state)
	}
	for _, id := range others {
		if rows[id].state != 1 || rows[id].attempts != 1 {
			t.Fatalf("message %s: %+v, want published at the first attempt", id, rows[id])
		}
	}
	testenv.Eventually(t, 10*time.Second, "metrics", func() bool {
		p, rt, d := counts(mp)
		return p == 201 && rt == maxAttempts-1 && d == 1
	})
	if len(mp.Points(telemetry.MetricOutboxBacklog)) == 0 {
		t.Error("no backlog sample")
	}

	// RequeueDead makes it pending again; it fails again from attempt 1.
	n, err := ob.RequeueDead(context.Background(), ids[0])
	if err != nil || n != 1 {
		t.Fatalf("RequeueDead = %d, %v", n, err)
	}
	testenv.Eventually(t, 30*time.Second, "the requeued message dead again", func() bool {
		return countState(t, pool, ob, 2) == 1 && countState(t, pool, ob, 0) == 0
	})
	if got := seenPoison.Load(); got != 2*maxAttempts {
		t.Errorf("poison message published %d times after the requeue, want %d", got, 2*maxAttempts)
	}
}

func deref(s *string) string {
	if s == nil {
		return "<nil>"
	}
	return *s
}

// A Publish error for the whole batch (the broker down) counts no attempt:
// the relay backs off and sends the batch again when the broker is back, and
// once everything is dead or published it stops calling the publisher.
func TestBrokerDownCountsNoAttemptAndNoHotLoop(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	var down atomic.Bool
	down.Store(true)
	pub := &memPublisher{down: func() error {
		if down.Load() {
			return errors.New("broker unreachable")
		}
		return nil
	}}
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{MaxAttempts: 2}))
	if err != nil {
		t.Fatal(err)
	}
	idle := onIdle(r)
	start(t, r)
	var ids []string
	for i := range 10 {
		ids = append(ids, enqueue(t, pool, ob, msg("t", keyOf(i, 3), "x"))...)
	}
	testenv.Eventually(t, 20*time.Second, "several failed batches", func() bool { return pub.callCount() >= 5 })
	for id, ri := range rowsByID(t, pool, ob) {
		if ri.state != 0 || ri.attempts != 0 {
			t.Fatalf("message %s: %+v while the broker is down, want pending with 0 attempts", id, ri)
		}
	}
	down.Store(false)
	testenv.Eventually(t, 20*time.Second, "all published after the broker came back", func() bool {
		return countState(t, pool, ob, 1) == len(ids)
	})

	// Idle: the relay goes back to waiting again and again (it polls, not
	// spins), and the publisher is not called.
	calls := pub.callCount()
	idleWaits(t, idle, 5)
	if got := pub.callCount(); got != calls {
		t.Errorf("publisher called %d times with nothing to publish", got-calls)
	}
}

// When every message fails, the relay works through the attempts and then
// stops calling the publisher: no hot loop.
func TestAllFailingEndsQuiet(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	pub := &memPublisher{fail: func(*outbox.Message) error { return errBoom }}
	const maxAttempts = 3
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{MaxAttempts: maxAttempts}))
	if err != nil {
		t.Fatal(err)
	}
	var batches atomic.Int64
	pgoutbox.SetAfterPublish(r, func([]*outbox.Message, error) { batches.Add(1) })
	idle := onIdle(r)
	start(t, r)
	const n = 30
	for i := range n {
		enqueue(t, pool, ob, msg("t", keyOf(i, 10), "x"))
	}
	testenv.Eventually(t, 30*time.Second, "all dead", func() bool { return countState(t, pool, ob, 2) == n })
	b := batches.Load()
	// Each message is tried maxAttempts times; a batch holds at least one.
	if b > n*maxAttempts {
		t.Errorf("%d batches for %d messages × %d attempts", b, n, maxAttempts)
	}
	idleWaits(t, idle, 5)
	if got := batches.Load(); got != b {
		t.Errorf("%d more batches after every message was dead", got-b)
	}
}

// Published rows are marked, then deleted by Cleanup after Retention in
// bounded batches; with DeletePublished they are deleted at once.
func TestCleanupAndDeletePublished(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	ob := newOutbox(t, pool, pgoutbox.Options{Retention: time.Millisecond, CleanupBatch: 7})
	pub := &memPublisher{}
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{CleanupInterval: -1}))
	if err != nil {
		t.Fatal(err)
	}
	rr := start(t, r)
	for i := range 30 {
		enqueue(t, pool, ob, msg("t", keyOf(i, 5), "x"))
	}
	testenv.Eventually(t, 20*time.Second, "all published", func() bool { return countState(t, pool, ob, 1) == 30 })
	rr.stop(t)
	n, err := ob.Cleanup(context.Background())
	if err != nil || n != 30 {
		t.Fatalf("Cleanup = %d, %v; want 30", n, err)
	}

	ob2 := newOutbox(t, pool, pgoutbox.Options{})
	pub2 := &memPublisher{}
	r2, err := pgoutbox.NewRelay(ob2, pub2, fastRelay(pgoutbox.RelayOptions{DeletePublished: true}))
	if err != nil {
		t.Fatal(err)
	}
	start(t, r2)
	enqueue(t, pool, ob2, msg("t", "a", "1"), msg("t", "a", "2"), msg("t", "", "3"))
	testenv.Eventually(t, 20*time.Second, "all published", func() bool { return len(pub2.published()) == 3 })
	testenv.Eventually(t, 20*time.Second, "rows deleted", func() bool {
		var c int
		_ = pool.QueryRow(context.Background(), "SELECT count(*) FROM "+ob2.Table()).Scan(&c)
		return c == 0
	})
}

// With polling and rebalancing practically off, only the notification sent
// at commit can wake the relay; a row inserted without a notification is
// found by the poll.
func TestNotifyWakesRelayAndPollingCatchesTheRest(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	pub := &memPublisher{}
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{PollInterval: time.Hour, RebalanceInterval: time.Hour}))
	if err != nil {
		t.Fatal(err)
	}
	var sessions atomic.Int32
	pgoutbox.SetOnConnect(r, func(uint32) { sessions.Add(1) })
	idle := onIdle(r)
	rr := start(t, r)
	// Let the session connect, take its shards and go idle: from then on
	// only a notification wakes it.
	waitIdle(t, idle)
	if n := sessions.Load(); n != 1 {
		t.Fatalf("%d sessions connected, want 1", n)
	}
	for i := range 3 {
		enqueue(t, pool, ob, msg("t", keyOf(i, 2), fmt.Sprint(i)))
		testenv.Eventually(t, 20*time.Second, "the message published on the notification", func() bool { return len(pub.published()) == i+1 })
	}
	rr.stop(t)

	// A lost notification: a row written without one waits for the poll.
	r2, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{PollInterval: 50 * time.Millisecond, RebalanceInterval: time.Hour}))
	if err != nil {
		t.Fatal(err)
	}
	idle2 := onIdle(r2)
	start(t, r2)
	waitIdle(t, idle2) // the first claim found nothing: the silent row comes after it
	if _, err := pool.Exec(context.Background(), "INSERT INTO "+ob.Table()+
		" (id, topic, key, key_hash, payload) VALUES ('0190a0b0-0000-7000-8000-0000000000aa', 't', 'silent', 7, 'x')"); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 20*time.Second, "the silent row published by the poll", func() bool { return len(pub.published()) == 4 })
}

func TestRunWithoutMigrateFails(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 2)
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: testenv.Schema(t, pool), Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	r, err := pgoutbox.NewRelay(ob, &memPublisher{}, fastRelay(pgoutbox.RelayOptions{}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := r.Run(ctx); err == nil || !strings.Contains(err.Error(), "Migrate") || ctx.Err() != nil {
		t.Fatalf("Run on a missing table = %v; want an error naming Migrate, at once", err)
	}
}

// NoKeyLock: a second transaction enqueueing the same key does not wait.
func TestNoKeyLock(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	ob := newOutbox(t, pool, pgoutbox.Options{NoKeyLock: true})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tx1, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx1.Rollback(ctx) }()
	if _, err := ob.Enqueue(ctx, tx1, msg("t", "k", "1")); err != nil {
		t.Fatal(err)
	}
	enqueue(t, pool, ob, msg("t", "k", "2")) // would block with the key lock
}

// NoNotify: Enqueue sends no notification, and a relay finds the row by
// polling. A listener on the channel receives, as its first notification,
// the marker sent after the NoNotify transaction committed.
func TestNoNotify(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	ob := newOutbox(t, pool, pgoutbox.Options{NoNotify: true})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{ob.Channel()}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	enqueue(t, pool, ob, msg("t", "k", "1"))
	if _, err := pool.Exec(ctx, "SELECT pg_notify($1, 'marker')", ob.Channel()); err != nil {
		t.Fatal(err)
	}
	n, err := conn.Conn().WaitForNotification(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n.Payload != "marker" {
		t.Fatalf("first notification on %s: %q, want the marker (Enqueue notified)", ob.Channel(), n.Payload)
	}
	_, _ = conn.Exec(ctx, "UNLISTEN *")

	pub := &memPublisher{}
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{PollInterval: 20 * time.Millisecond, RebalanceInterval: time.Hour}))
	if err != nil {
		t.Fatal(err)
	}
	idle := onIdle(r)
	start(t, r)
	testenv.Eventually(t, 20*time.Second, "the first row published", func() bool { return len(pub.published()) == 1 })
	waitIdle(t, idle)
	enqueue(t, pool, ob, msg("t", "k", "2"))
	testenv.Eventually(t, 20*time.Second, "the second row published by the poll", func() bool { return len(pub.published()) == 2 })
}

// Dead rows are kept unless DeadRetention is set.
func TestDeadRetention(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	ob := newOutbox(t, pool, pgoutbox.Options{DeadRetention: time.Millisecond, Retention: time.Hour})
	pub := &memPublisher{fail: func(*outbox.Message) error { return errBoom }}
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{MaxAttempts: 1, CleanupInterval: -1}))
	if err != nil {
		t.Fatal(err)
	}
	rr := start(t, r)
	enqueue(t, pool, ob, msg("t", "a", "1"), msg("t", "b", "2"))
	testenv.Eventually(t, 20*time.Second, "both dead", func() bool { return countState(t, pool, ob, 2) == 2 })
	rr.stop(t)
	testenv.Eventually(t, 20*time.Second, "both dead rows older than DeadRetention", func() bool {
		var n int
		err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+ob.Table()+" WHERE dead_at < clock_timestamp() - interval '1 millisecond'").Scan(&n)
		return err == nil && n == 2
	})
	if n, err := ob.Cleanup(context.Background()); err != nil || n != 2 {
		t.Fatalf("Cleanup = %d, %v; want the 2 dead rows", n, err)
	}
}
