package pgoutbox_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// TestDeadPagesAndDeletes: messages the relay parked as dead come back
// from Dead page by page in the order they were parked, with their last
// error; DeleteDead deletes only dead messages, and RequeueDead makes a
// dead message pending again, after which Dead no longer lists it.
func TestDeadPagesAndDeletes(t *testing.T) {
	pool := testenv.Pool(t, 6)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	pub := &memPublisher{fail: func(m *outbox.Message) error {
		if strings.HasPrefix(string(m.Payload), "poison") {
			return errors.New("rejected by the broker")
		}
		return nil
	}}
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{MaxAttempts: 2}))
	if err != nil {
		t.Fatal(err)
	}
	var poison []string
	for i := range 5 {
		poison = append(poison, enqueue(t, pool, ob, outbox.Message{Topic: "t", Key: []byte(fmt.Sprint("k", i)),
			Payload: []byte(fmt.Sprint("poison-", i)), Headers: map[string]string{"h": "v"}})...)
	}
	good := enqueue(t, pool, ob, outbox.Message{Topic: "t", Payload: []byte("fine")})
	rr := start(t, r)
	testenv.Eventually(t, 30*time.Second, "five dead messages", func() bool {
		return countState(t, pool, ob, 2) == 5 && countState(t, pool, ob, 0) == 0
	})
	rr.stop(t)

	ctx := testenv.Ctx(t)
	var all []pgoutbox.DeadMessage
	var after *pgoutbox.DeadMessage
	for {
		page, err := ob.Dead(ctx, after, 2)
		if err != nil {
			t.Fatal(err)
		}
		if len(page) > 2 {
			t.Fatalf("a page of %d, limit 2", len(page))
		}
		if len(page) == 0 {
			break
		}
		all = append(all, page...)
		after = &page[len(page)-1]
	}
	var ids []string
	for i, m := range all {
		ids = append(ids, m.ID)
		if m.Attempts != 2 || m.LastError == "" || !strings.Contains(m.LastError, "rejected by the broker") ||
			m.Topic != "t" || m.Headers["h"] != "v" || !strings.HasPrefix(string(m.Payload), "poison-") || m.DeadAt.IsZero() {
			t.Errorf("dead message %+v", m)
		}
		if i > 0 && (m.DeadAt.Before(all[i-1].DeadAt) || (m.DeadAt.Equal(all[i-1].DeadAt) && m.Seq <= all[i-1].Seq)) {
			t.Errorf("dead messages out of order at %d", i)
		}
	}
	if slices.Sort(ids); !slices.Equal(ids, slices.Sorted(slices.Values(poison))) {
		t.Fatalf("Dead listed %v, want %v", ids, poison)
	}

	n, err := ob.DeleteDead(ctx, poison[0], poison[1], good[0])
	if err != nil || n != 2 {
		t.Fatalf("DeleteDead = %d, %v; want 2 (the published message is not dead)", n, err)
	}
	if n, err := ob.RequeueDead(ctx, poison[2]); err != nil || n != 1 {
		t.Fatalf("RequeueDead = %d, %v", n, err)
	}
	left, err := ob.Dead(ctx, nil, 10)
	if err != nil {
		t.Fatal(err)
	}
	var leftIDs []string
	for _, m := range left {
		leftIDs = append(leftIDs, m.ID)
	}
	if want := []string{poison[3], poison[4]}; !slices.Equal(slices.Sorted(slices.Values(leftIDs)), slices.Sorted(slices.Values(want))) {
		t.Errorf("dead after delete and requeue: %v, want %v", leftIDs, want)
	}
	if _, err := ob.Dead(ctx, nil, 0); err == nil {
		t.Error("Dead with limit 0: nil error")
	}
}
