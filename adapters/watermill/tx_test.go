package idemwatermill_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// committed counts, outside any transaction, the committed effects of id and
// the committed claims of (scope, id), found by the key's digest.
func committed(t *testing.T, fx *fixture, scope, id string) (effects, claims int) {
	t.Helper()
	ctx := context.Background()
	if err := fx.pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{fx.schema, "effects"}.Sanitize()+" WHERE id = $1", id).Scan(&effects); err != nil {
		t.Fatal(err)
	}
	if err := fx.pool.QueryRow(ctx, "SELECT count(*) FROM "+fx.pgStore.Table()+" WHERE key = encode(substring(sha256(convert_to($1::text, 'UTF8') || decode('00', 'hex') || convert_to($2::text, 'UTF8')) FROM 1 FOR 16), 'hex')::uuid", scope, id).Scan(&claims); err != nil {
		t.Fatal(err)
	}
	return effects, claims
}

// TestTransactionalRollsBackAndRetries: the handler writes its effect through
// the claim's transaction, then fails (an error, or a panic caught by
// Watermill's Recoverer). Its write and the claim roll back together: the
// retry finds neither committed, runs, and commits both; the duplicate
// delivered afterwards does not run the handler.
func TestTransactionalRollsBackAndRetries(t *testing.T) {
	t.Parallel()
	for _, failure := range []string{"error", "panic"} {
		for _, mode := range retryModes {
			t.Run(failure+"/"+mode, func(t *testing.T) {
				fx := pgTxKind().setup(t)
				ps := newGoChannel(t)
				r := newRouter(t)
				if mode == "retry_middleware" {
					r.AddMiddleware(fastRetry(3).Middleware)
				}
				r.AddMiddleware(middleware.Recoverer, fx.middleware(t, idemwatermill.Options{}))
				var (
					attempts      atomic.Int32
					seenByRetry   [2]int
					txInFirstCall bool
				)
				topic := testenv.Name("orders")
				r.AddConsumerHandler("charge", topic, ps, func(msg *message.Message) error {
					n := attempts.Add(1)
					if n == 2 {
						seenByRetry[0], seenByRetry[1] = committed(t, fx, "charge", msg.UUID)
					}
					if err := fx.oracle.record(msg, "charge"); err != nil {
						return err
					}
					if n == 1 {
						txInFirstCall = idemwatermill.Tx[pgx.Tx](msg.Context()) != nil
						if failure == "panic" {
							panic("charge: nil pointer in the receipt template")
						}
						return errGateway
					}
					return nil
				})
				startRouter(t, r)

				msg := message.NewMessage(wm.NewUUID(), []byte(`{"order":"B-7"}`))
				for range 2 {
					if err := ps.Publish(topic, msg.Copy()); err != nil {
						t.Fatal(err)
					}
				}
				if !txInFirstCall {
					t.Error("Tx(msg.Context()) was nil inside the handler")
				}
				if seenByRetry != [2]int{0, 0} {
					t.Errorf("the retry saw %d effects and %d claims committed by the failed attempt, want none", seenByRetry[0], seenByRetry[1])
				}
				if n := attempts.Load(); n != 2 {
					t.Errorf("handler ran %d times, want 2", n)
				}
				effects, claims := committed(t, fx, "charge", msg.UUID)
				if effects != 1 || claims != 1 {
					t.Errorf("committed %d effects and %d claims, want 1 and 1", effects, claims)
				}
			})
		}
	}
}

// TestTransactionalContext: the handler sees the transaction in its message's
// context only while it runs; the message gets its own context back.
func TestTransactionalContext(t *testing.T) {
	t.Parallel()
	fx := pgTxKind().setup(t)
	mw := fx.middleware(t, idemwatermill.Options{Scope: "orders/ctx"})
	msg := message.NewMessage(wm.NewUUID(), []byte("x"))
	orig := msg.Context()
	var inside pgx.Tx
	h := mw(func(m *message.Message) ([]*message.Message, error) {
		inside = idemwatermill.Tx[pgx.Tx](m.Context())
		var one int
		return nil, inside.QueryRow(m.Context(), "SELECT 1").Scan(&one)
	})
	if _, err := h(msg); err != nil {
		t.Fatal(err)
	}
	if inside == nil {
		t.Fatal("no transaction in the handler's context")
	}
	if msg.Context() != orig || idemwatermill.Tx[pgx.Tx](msg.Context()) != nil {
		t.Error("the message kept the handler's context")
	}
	if idemwatermill.Tx[pgx.Tx](context.Background()) != nil {
		t.Error("Tx outside the middleware is not nil")
	}
}

// newOutbox migrates a pgoutbox table in the fixture's schema.
func newOutbox(t *testing.T, fx *fixture) *pgoutbox.Outbox {
	t.Helper()
	ob := must(pgoutbox.New(fx.pool, pgoutbox.Options{Schema: fx.schema, Logger: slog.New(slog.DiscardHandler)}))
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return ob
}

type outboxRow struct {
	id, topic, payload, source string
}

func outboxRows(t *testing.T, fx *fixture, ob *pgoutbox.Outbox) []outboxRow {
	t.Helper()
	rows, err := fx.pool.Query(context.Background(), "SELECT id::text, topic, convert_from(payload, 'UTF8'), coalesce(headers->>'source', '') FROM "+ob.Table()+" ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	var out []outboxRow
	var r outboxRow
	if _, err := pgx.ForEachRow(rows, []any{&r.id, &r.topic, &r.payload, &r.source}, func() error { out = append(out, r); return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestTransactionalOutbox: with Options.Outbox, the messages the handler
// returns are written to the outbox in the claim's transaction instead of
// being published by the router. The first attempt returns its messages and
// fails: they roll back with it. Each message then has its receipt in the
// outbox once, under the handler's publish topic, with the UUID the handler
// gave it.
func TestTransactionalOutbox(t *testing.T) {
	t.Parallel()
	fx := pgTxKind().setup(t)
	ob := newOutbox(t, fx)
	ps := newGoChannel(t)
	routerPub := &recordingPublisher{}
	r := newRouter(t)
	r.AddMiddleware(fx.middleware(t, idemwatermill.Options{Outbox: ob}))
	var attempts atomic.Int32
	receipts := map[string]string{}
	var mu sync.Mutex
	topic := testenv.Name("orders")
	r.AddHandler("charge", topic, ps, "receipts", routerPub, func(msg *message.Message) ([]*message.Message, error) {
		if err := fx.oracle.record(msg, "charge"); err != nil {
			return nil, err
		}
		receipt := message.NewMessage(wm.NewUUID(), []byte("receipt for "+string(msg.Payload)))
		receipt.Metadata.Set("source", msg.UUID)
		if attempts.Add(1) == 1 {
			return []*message.Message{receipt}, errGateway
		}
		mu.Lock()
		receipts[msg.UUID] = receipt.UUID
		mu.Unlock()
		return []*message.Message{receipt}, nil
	})
	startRouter(t, r)

	var ids []string
	for i := range 3 {
		msg := message.NewMessage(wm.NewUUID(), fmt.Appendf(nil, "order-%d", i))
		ids = append(ids, msg.UUID)
		for range 2 { // and a duplicate
			if err := ps.Publish(topic, msg.Copy()); err != nil {
				t.Fatal(err)
			}
		}
	}

	if _, sent := routerPub.published(); len(sent) != 0 {
		t.Errorf("the router published %d messages; they belong in the outbox", len(sent))
	}
	rows := outboxRows(t, fx, ob)
	if len(rows) != len(ids) {
		t.Fatalf("outbox has %d rows, want %d (one receipt per order; the failed attempt's rolled back): %v", len(rows), len(ids), rows)
	}
	for i, row := range rows {
		if row.topic != "receipts" || row.payload != fmt.Sprintf("receipt for order-%d", i) {
			t.Errorf("row %d = %+v", i, row)
		}
		if want := receipts[ids[i]]; row.id != want || row.source != ids[i] {
			t.Errorf("row %d has id %s and source %s, want the handler's UUID %s and source %s", i, row.id, row.source, want, ids[i])
		}
	}
	if pending, _, err := ob.Backlog(context.Background()); err != nil || pending != int64(len(ids)) {
		t.Errorf("backlog = %d, %v; want %d", pending, err, len(ids))
	}
}

// TestOutboxRelayToWatermill: consume, write and produce end to end. The
// handler's receipts go to the outbox in its transaction; the outbox relay
// publishes them through Publisher to another Watermill pub/sub, where a
// downstream handler under Dedup receives each once, with the outbox row id
// as its UUID (the handler's own UUID, kept) and in the idem-message-id
// metadata.
func TestOutboxRelayToWatermill(t *testing.T) {
	t.Parallel()
	fx := pgTxKind().setup(t)
	ob := newOutbox(t, fx)
	upstream := newGoChannel(t)
	downstream := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, nopLogger)
	t.Cleanup(func() { _ = downstream.Close() })

	pub := must(idemwatermill.NewPublisher(downstream))
	relay := must(pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{Shards: 1, PollInterval: 100 * time.Millisecond, CleanupInterval: -1}))
	ctx, cancel := context.WithCancel(context.Background())
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-relayDone; err != nil {
			t.Errorf("relay: %v", err)
		}
	})

	const n = 4
	got := make(chan *message.Message, 2*n)
	r := newRouter(t)
	r.AddHandler("charge", "orders", upstream, "receipts", &recordingPublisher{},
		func(msg *message.Message) ([]*message.Message, error) {
			if err := fx.oracle.record(msg, "charge"); err != nil {
				return nil, err
			}
			return []*message.Message{message.NewMessage(wm.NewUUID(), append([]byte("receipt:"), msg.Payload...))}, nil
		}).AddMiddleware(fx.middleware(t, idemwatermill.Options{Outbox: ob}))
	r.AddConsumerHandler("email", "receipts", downstream, func(msg *message.Message) error {
		got <- msg
		return nil
	}).AddMiddleware(must(idemwatermill.Dedup(newMemstore(t), idemwatermill.Options{})))
	startRouter(t, r)

	for i := range n {
		msg := message.NewMessage(wm.NewUUID(), fmt.Appendf(nil, "%d", i))
		for range 2 {
			if err := upstream.Publish("orders", msg.Copy()); err != nil {
				t.Fatal(err)
			}
		}
	}
	rows := outboxRows(t, fx, ob)
	if len(rows) != n {
		t.Fatalf("outbox has %d rows, want %d", len(rows), n)
	}
	want := map[string]bool{}
	for _, row := range rows {
		want[row.id] = true
	}
	for range n {
		select {
		case m := <-got:
			if !want[m.UUID] {
				t.Errorf("received %s, not an outbox row id (or twice)", m.UUID)
			}
			delete(want, m.UUID)
			if m.Metadata.Get(outbox.HeaderMessageID) != m.UUID {
				t.Errorf("metadata %s = %q, want the UUID %s", outbox.HeaderMessageID, m.Metadata.Get(outbox.HeaderMessageID), m.UUID)
			}
		case <-time.After(time.Minute): // a hang guard, not a timing assertion
			t.Fatalf("the relay delivered %d of %d receipts", n-len(want), n)
		}
	}
}

// TestTransactionalOutboxNeedsTopic: a handler without a publish topic that
// returns messages under Options.Outbox fails (and rolls back) with a hint,
// unless Options.OutboxTopic names one.
func TestTransactionalOutboxNeedsTopic(t *testing.T) {
	t.Parallel()
	fx := pgTxKind().setup(t)
	ob := newOutbox(t, fx)
	produce := func(m *message.Message) ([]*message.Message, error) {
		if err := fx.oracle.record(m, "direct"); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage("not-a-uuid", []byte("r"))}, nil
	}
	mw := fx.middleware(t, idemwatermill.Options{Scope: "direct", Outbox: ob})
	msg := message.NewMessage(wm.NewUUID(), []byte("x"))
	if _, err := mw(produce)(msg); err == nil || !strings.Contains(err.Error(), "OutboxTopic") {
		t.Fatalf("err = %v, want a hint about OutboxTopic", err)
	}
	if effects, claims := committed(t, fx, "direct", msg.UUID); effects != 0 || claims != 0 {
		t.Fatalf("committed %d effects, %d claims after the failure", effects, claims)
	}
	mw = fx.middleware(t, idemwatermill.Options{Scope: "direct", Outbox: ob, OutboxTopic: "receipts", OutboxKey: func(*message.Message) []byte { return []byte("k") }})
	out, err := mw(produce)(msg)
	if err != nil || out != nil {
		t.Fatalf("out, err = %v, %v; want nil, nil", out, err)
	}
	rows := outboxRows(t, fx, ob)
	if len(rows) != 1 || rows[0].topic != "receipts" {
		t.Fatalf("rows = %+v", rows)
	}
	if rows[0].id == "not-a-uuid" || rows[0].id == "" {
		t.Errorf("a message whose UUID is not a UUID got id %q; want one assigned by the outbox", rows[0].id)
	}
}

// TestTransactionalClaimErrors: a duplicate is acknowledged without running
// the handler; a key held by a lease-mode claim is in flight (retried); a
// content conflict is poison.
func TestTransactionalClaimErrors(t *testing.T) {
	t.Parallel()
	fx := pgTxKind().setup(t)
	mw := fx.middleware(t, idemwatermill.Options{Scope: "orders"})
	var runs atomic.Int32
	h := mw(func(m *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		return []*message.Message{message.NewMessage(wm.NewUUID(), nil)}, nil
	})
	msg := message.NewMessage(wm.NewUUID(), []byte("a"))
	out, err := h(msg)
	if err != nil || len(out) != 1 {
		t.Fatalf("first: %v, %v", out, err)
	}
	out, err = h(msg.Copy())
	if err != nil || out != nil || runs.Load() != 1 {
		t.Fatalf("duplicate: out %v, err %v, runs %d", out, err, runs.Load())
	}
	forged := message.NewMessage(msg.UUID, []byte("b"))
	if _, err := h(forged); !idemwatermill.IsPoison(err) || !errors.Is(err, dedup.ErrFingerprintMismatch) {
		t.Fatalf("forged: %v", err)
	}
	held := message.NewMessage(wm.NewUUID(), []byte("c"))
	lease, err := fx.pgStore.Lease().Claim(context.Background(), dedup.NewKey("orders", held.UUID, held.Payload))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = fx.pgStore.Lease().Release(context.Background(), lease) }()
	if _, err := h(held); !errors.Is(err, dedup.ErrInFlight) || !idemwatermill.Retryable(err) {
		t.Fatalf("held by a lease: %v", err)
	}
	if runs.Load() != 1 {
		t.Fatalf("handler ran %d times", runs.Load())
	}
}

// TestTransactionalLeaseClaimWaits: a claim that is not the middleware's
// (pgtable's lease mode on the same table) of a key whose handler runs waits
// for the handler's transaction, then sees the key done: the effect and the
// key's row are the transaction's, once.
func TestTransactionalLeaseClaimWaits(t *testing.T) {
	t.Parallel()
	fx := pgTxKind().setup(t)
	var outcomes []string
	mw := fx.middleware(t, idemwatermill.Options{Scope: "charge", Telemetry: consumer.Telemetry{OnOutcome: func(_ context.Context, r consumer.Report) { outcomes = append(outcomes, string(r.Outcome)) }}})
	msg := message.NewMessage(wm.NewUUID(), []byte(`{"amount":100}`))
	leased := make(chan error, 1)
	ran := 0
	h := mw(func(msg *message.Message) ([]*message.Message, error) {
		ran++
		if err := fx.oracle.record(msg, "charge"); err != nil {
			return nil, err
		}
		go func() {
			_, err := fx.pgStore.Lease().Claim(context.Background(), dedup.Key{Scope: "charge", ID: msg.UUID, Fingerprint: dedup.FingerprintOf(msg.Payload)})
			leased <- err
		}()
		var pid uint32
		if err := idemwatermill.Tx[pgx.Tx](msg.Context()).QueryRow(msg.Context(), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			return nil, err
		}
		testenv.Eventually(t, 30*time.Second, "the lease claim to wait for the handler's transaction", func() bool {
			var n int
			err := fx.pool.QueryRow(context.Background(),
				`SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY (pg_blocking_pids(pid))`, int32(pid)).Scan(&n)
			return err == nil && n == 1
		})
		return nil, nil
	})
	out, err := h(msg)
	if err != nil || out != nil {
		t.Fatalf("handler: returned %v, %v; want it acknowledged", out, err)
	}
	if err := <-leased; !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("the lease claim after the commit = %v, want ErrDuplicate", err)
	}
	effects, claims := committed(t, fx, "charge", msg.UUID)
	if ran != 1 || effects != 1 || claims != 1 {
		t.Fatalf("ran %d, committed effects %d, key rows %d; want 1, 1, 1", ran, effects, claims)
	}
	if len(outcomes) != 1 || outcomes[0] != "completed" {
		t.Fatalf("outcomes %v, want [completed]", outcomes)
	}
}
