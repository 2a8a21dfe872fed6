package pgoutbox_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// A claim passes over rows another transaction holds to fill its batch,
// and drops every message of a key from its first held one, even when it
// could lock a later message of that key.
func TestClaimPassesOverHeldRows(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	held := enqueue(t, pool, ob, msg("t", "held", "held-1"), msg("t", "held", "held-2"))
	var others []outbox.Message
	for i := range 10 {
		others = append(others, msg("t", fmt.Sprint("other-", i), fmt.Sprint("other-", i)))
	}
	enqueue(t, pool, ob, others...)

	// Another transaction holds the key's first message.
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "SELECT 1 FROM "+ob.Table()+" WHERE id = $1::uuid FOR UPDATE", held[0]); err != nil {
		t.Fatal(err)
	}

	// Two per batch, two per key: the oldest candidates are both messages
	// of the held key.
	pub := &memPublisher{}
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{BatchSize: 2, PerKeyBatch: 2, CleanupInterval: -1}))
	if err != nil {
		t.Fatal(err)
	}
	start(t, r)
	testenv.Eventually(t, 30*time.Second, "the other keys' messages published past the held rows", func() bool {
		return countState(t, pool, ob, 1) == len(others)
	})
	for _, m := range pub.published() {
		if string(m.Key) == "held" {
			t.Fatalf("%s published while the key's first message is held by another transaction", m.Payload)
		}
	}

	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the held key's messages published", func() bool { return countState(t, pool, ob, 0) == 0 })
	var order []string
	for _, m := range pub.published() {
		if string(m.Key) == "held" {
			order = append(order, string(m.Payload))
		}
	}
	if !slices.Equal(order, []string{"held-1", "held-2"}) {
		t.Errorf("held key published as %v, want [held-1 held-2]", order)
	}
}
