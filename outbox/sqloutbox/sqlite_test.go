package sqloutbox_test

import (
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/sqloutbox"
)

// The SQLite relay publishes while two producers enqueue: every committed
// message once, in per-key order, nothing rolled back, and a poison message
// dead after MaxAttempts without holding up the rest; a message published
// at its third attempt still comes before the later ones of its key.
func TestSQLiteRelay(t *testing.T) {
	t.Parallel()
	db := sqliteDB(t)
	ob := newOutbox(t, db, sqloutbox.SQLite, sqloutbox.Options{})
	const (
		keys, perKey = 10, 20
		maxAttempts  = 3
		poison       = "k03/7"
		flaky        = "f/1" // rejected at its first two attempts
	)
	pub := &memPublisher{fail: func(m *outbox.Message) error {
		if p := string(m.Payload); p == poison || (p == flaky && m.Attempt < 3) {
			return errors.New("rejected")
		}
		return nil
	}}
	r, err := sqloutbox.NewRelay(ob, pub, fastRelay(sqloutbox.RelayOptions{BatchSize: 7, MaxAttempts: maxAttempts, CleanupInterval: -1}))
	if err != nil {
		t.Fatal(err)
	}
	// The flaky message's key has later messages before the relay starts.
	committed := map[string]string{}
	for n := range 5 {
		m := msg("t", "f", fmt.Sprintf("f/%d", n))
		committed[enqueue(t, db, ob, m)[0]] = string(m.Payload)
	}
	start(t, r)
	ctx := testenv.Ctx(t)
	var (
		mu         sync.Mutex
		rolledBack []string
		wg         sync.WaitGroup
	)
	errs := make(chan error, 2)
	for p := range 2 {
		wg.Go(func() {
			for n := range perKey {
				for k := p; k < keys; k += 2 {
					key := fmt.Sprintf("k%02d", k)
					ms := []outbox.Message{msg("t", key, fmt.Sprintf("%s/%d", key, n)), msg("t", "", "nokey")}
					ids, err := enqueueTx(ctx, db, ob, true, ms...)
					if err != nil {
						errs <- err
						return
					}
					rb, err := enqueueTx(ctx, db, ob, false, msg("t", key, "rolledback"))
					if err != nil {
						errs <- err
						return
					}
					mu.Lock()
					for i, id := range ids {
						committed[id] = string(ms[i].Payload)
					}
					rolledBack = append(rolledBack, rb...)
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	testenv.Eventually(t, 60*time.Second, "no row pending", func() bool { return countState(t, db, ob, 0) == 0 })
	got := pub.publishedIDs()
	for id, p := range committed {
		want := 1
		if p == poison {
			want = 0
		}
		if got[id] != want {
			t.Errorf("message %s (%s) published %d times, want %d", id, p, got[id], want)
		}
	}
	for _, id := range rolledBack {
		if got[id] != 0 {
			t.Errorf("rolled back message %s published", id)
		}
	}
	var payloads []string
	for _, m := range pub.published() {
		if p := string(m.Payload); p != "nokey" {
			payloads = append(payloads, p)
		}
	}
	if bad := orderViolations(payloads); len(bad) > 0 {
		t.Fatalf("per-key order violated: %v", bad)
	}
	var state, attempts int
	if err := db.QueryRowContext(ctx, "SELECT state, attempts FROM "+ob.Table()+" WHERE payload = ?", []byte(poison)).Scan(&state, &attempts); err != nil {
		t.Fatal(err)
	}
	if state != 2 || attempts != maxAttempts {
		t.Fatalf("poison row: state %d, attempts %d; want dead after %d", state, attempts, maxAttempts)
	}
	if n := countState(t, db, ob, 1); n != len(committed)-1 {
		t.Fatalf("%d rows published, want %d", n, len(committed)-1)
	}
}
