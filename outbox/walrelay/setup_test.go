package walrelay_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

// Check names what is wrong and the statement that fixes it: here
// wal_level on the shared test database, which runs with the default
// replica level. On the logical cluster it passes.
func TestCheck(t *testing.T) {
	t.Parallel()
	shared := testenv.Pool(t, 2)
	var level string
	if err := shared.QueryRow(context.Background(), "SHOW wal_level").Scan(&level); err != nil {
		t.Fatal(err)
	}
	if level != "logical" {
		ob, err := walrelay.New(shared, walrelay.Options{Logger: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		err = ob.Check(context.Background())
		if !errors.Is(err, walrelay.ErrSetup) || !strings.Contains(err.Error(), "ALTER SYSTEM SET wal_level = logical") ||
			!strings.Contains(err.Error(), "restart PostgreSQL") {
			t.Fatalf("Check on wal_level=%s: %v; want ErrSetup naming the fix", level, err)
		}
		if err := ob.Migrate(context.Background()); !errors.Is(err, walrelay.ErrSetup) {
			t.Fatalf("Migrate on wal_level=%s: %v; want ErrSetup", level, err)
		}
	}
	ob, err := walrelay.New(logicalPool(t), walrelay.Options{Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Check(context.Background()); err != nil {
		t.Fatalf("Check on the logical cluster: %v", err)
	}
}

// Slot shows the slot (active while a relay streams it, its lag), DropSlot
// refuses while a relay streams it and drops it once the relay stopped.
func TestSlotShowAndDrop(t *testing.T) {
	t.Parallel()
	pool := logicalPool(t)
	ob := newWAL(t, pool, walrelay.Options{})
	ctx := context.Background()
	s, err := ob.Slot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if s.Name != ob.Options().Slot || s.Plugin != "pgoutput" || s.Active || s.ConfirmedLSN == "" {
		t.Fatalf("slot after Migrate: %+v", s)
	}
	enqueue(t, pool, ob, msg("t", "k", "x"))
	if s, err = ob.Slot(ctx); err != nil || s.LagBytes <= 0 {
		t.Fatalf("lag with a message not relayed: %+v, %v", s, err)
	}

	r := newRelay(t, ob, newMemPublisher(), walrelay.RelayOptions{})
	streaming := make(chan struct{}, 1)
	walrelay.SetOnStreaming(r, func() { streaming <- struct{}{} })
	rr := start(t, r)
	<-streaming
	if err := ob.DropSlot(ctx); !errors.Is(err, walrelay.ErrSlotActive) {
		t.Fatalf("DropSlot while streaming: %v; want ErrSlotActive", err)
	}
	if s, err = ob.Slot(ctx); err != nil || !s.Active || s.ActivePID == 0 {
		t.Fatalf("slot while streaming: %+v, %v", s, err)
	}
	rr.stop(t)
	for {
		err := ob.DropSlot(ctx)
		if err == nil {
			break
		}
		if !errors.Is(err, walrelay.ErrSlotActive) {
			t.Fatalf("DropSlot after the relay stopped: %v", err)
		}
	}
	if _, err := ob.Slot(ctx); !errors.Is(err, walrelay.ErrNoSlot) {
		t.Fatalf("Slot after DropSlot: %v; want ErrNoSlot", err)
	}
	if err := ob.DropSlot(ctx); !errors.Is(err, walrelay.ErrNoSlot) {
		t.Fatalf("DropSlot twice: %v; want ErrNoSlot", err)
	}
}

// A logical message with the outbox's prefix that is not an idem outbox
// message is parked in the dead table with its raw payload, under an id
// derived from its position, and the messages after it are published.
func TestCorruptMessageParked(t *testing.T) {
	t.Parallel()
	pool := logicalPool(t)
	ob := newWAL(t, pool, walrelay.Options{Source: walrelay.SourceMessages})
	pub := newMemPublisher()
	start(t, newRelay(t, ob, pub, walrelay.RelayOptions{}))
	ctx := context.Background()
	if _, err := pool.Exec(ctx, "SELECT pg_logical_emit_message(true, $1, 'not an outbox message'::bytea)", ob.Options().Prefix); err != nil {
		t.Fatal(err)
	}
	after := enqueue(t, pool, ob, msg("t", "", "after"))
	pub.waitIDs(t, after)
	var payload []byte
	var lastErr string
	if err := pool.QueryRow(ctx, "SELECT payload, last_error FROM "+ob.DeadTable()).Scan(&payload, &lastErr); err != nil {
		t.Fatalf("the corrupt message is not in the dead table: %v", err)
	}
	if string(payload) != "not an outbox message" || !strings.Contains(lastErr, "not an idem outbox message") {
		t.Fatalf("dead row: payload %q, error %q", payload, lastErr)
	}
}

// The table source's rows are never marked; Cleanup deletes them by age,
// and the relay has published them from the WAL all the same.
func TestCleanupByAge(t *testing.T) {
	t.Parallel()
	pool := logicalPool(t)
	ob := newWAL(t, pool, walrelay.Options{Source: walrelay.SourceTable, Retention: 1e6 /* 1ms */, CleanupBatch: 3})
	ids := enqueue(t, pool, ob, msg("t", "a", "1"), msg("t", "b", "2"), msg("t", "c", "3"), msg("t", "d", "4"))
	ctx := context.Background()
	if _, err := pool.Exec(ctx, "SELECT pg_sleep(0.01)"); err != nil {
		t.Fatal(err)
	}
	n, err := ob.Cleanup(ctx)
	if err != nil || n != 4 {
		t.Fatalf("Cleanup: %d, %v; want 4", n, err)
	}
	pub := newMemPublisher()
	start(t, newRelay(t, ob, pub, walrelay.RelayOptions{CleanupInterval: -1}))
	pub.waitIDs(t, ids)
}

// With no pool, an Outbox only enqueues; the options are validated.
func TestNewValidates(t *testing.T) {
	t.Parallel()
	for _, o := range []walrelay.Options{
		{Slot: "Bad-Name"}, {Publication: "bad name"}, {Source: 7}, {Table: strings.Repeat("t", 49)}, {Retention: -1},
	} {
		if _, err := walrelay.New(nil, o); err == nil {
			t.Errorf("New(%+v) accepted", o)
		}
	}
	ob, err := walrelay.New(nil, walrelay.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if o := ob.Options(); o.Source != walrelay.SourceMessages || o.Slot != "idem_outbox_public_outbox" || o.Publication != o.Slot || o.Prefix != "idem.outbox:public.outbox" {
		t.Fatalf("defaults: %+v", o)
	}
	if _, err := walrelay.NewRelay(ob, newMemPublisher(), walrelay.RelayOptions{}); err == nil {
		t.Fatal("NewRelay accepted an outbox without a pool")
	}
	if _, err := ob.Enqueue(context.Background(), pgx.Tx(nil), outbox.Message{}); err == nil {
		t.Fatal("Enqueue accepted a nil tx")
	}
}

func TestSourceText(t *testing.T) {
	t.Parallel()
	for _, src := range []walrelay.Source{walrelay.SourceMessages, walrelay.SourceTable, 0} {
		text, err := src.MarshalText()
		if err != nil {
			t.Fatalf("%v.MarshalText: %v", src, err)
		}
		var got walrelay.Source
		if err := got.UnmarshalText(text); err != nil || got != src {
			t.Errorf("UnmarshalText(%q) = %v, %v; want %v", text, got, err, src)
		}
	}
	if text, _ := walrelay.SourceTable.MarshalText(); string(text) != "table" {
		t.Errorf("SourceTable.MarshalText() = %q, want table", text)
	}
	var got walrelay.Source
	if err := got.UnmarshalText([]byte("wal")); err == nil {
		t.Error(`UnmarshalText("wal") accepted`)
	}
	if _, err := walrelay.Source(7).MarshalText(); err == nil {
		t.Error("Source(7).MarshalText accepted")
	}
}
