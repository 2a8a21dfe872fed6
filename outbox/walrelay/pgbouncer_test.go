package walrelay_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/testkit/pgbouncer"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox/walrelay"
)

// The WAL outbox through PgBouncer in transaction mode: Migrate (the
// publication and the slot), Enqueue and the relay's queries run on a pool
// through it; the replication connection does not go through it, and Run
// says to set RelayOptions.ConnConfig to a direct connection.

func TestPgBouncerReplicationRefused(t *testing.T) {
	b := pgbouncer.New(t, pgbouncer.Options{Upstream: logicalURL(t)})
	pool := b.Pool(t, 4)
	ob := newWAL(t, pool, walrelay.Options{Source: walrelay.SourceMessages})
	enqueue(t, pool, ob, msg("t", "k", "x"))
	pub := newMemPublisher()
	r := newRelay(t, ob, pub, walrelay.RelayOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := r.Run(ctx)
	if err == nil || ctx.Err() != nil {
		t.Fatalf("Run through PgBouncer = %v; want an error at once", err)
	}
	for _, want := range []string{"RelayOptions.ConnConfig", "direct connection", "unsupported startup parameter: replication"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Run's error does not say %q: %v", want, err)
		}
	}
	if len(pub.published()) != 0 {
		t.Fatal("the refused relay published")
	}
}

// With the replication connection direct, the messages that four
// producers enqueue through PgBouncer are each published once, in commit
// order per key.
func TestPgBouncerDirectReplication(t *testing.T) {
	sources(t, func(t *testing.T, src walrelay.Source) {
		url := logicalURL(t)
		b := pgbouncer.New(t, pgbouncer.Options{Upstream: url})
		pool := b.Pool(t, 8)
		ob := newWAL(t, pool, walrelay.Options{Source: src})
		direct, err := pgx.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		pub := newMemPublisher()
		start(t, newRelay(t, ob, pub, walrelay.RelayOptions{ConnConfig: &direct.Config}))

		const producers, each = 4, 50
		var (
			mu   sync.Mutex
			want []string
			wg   sync.WaitGroup
		)
		errs := make(chan error, producers)
		for p := range producers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx := testenv.Ctx(t)
				for i := range each {
					key := fmt.Sprintf("p%d", p) // one producer per key: its commit order is its loop order
					var ids []string
					err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
						var err error
						ids, err = ob.Enqueue(ctx, tx, msg("t", key, fmt.Sprint(i)))
						return err
					})
					if err != nil {
						errs <- err
						return
					}
					mu.Lock()
					want = append(want, ids...)
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatalf("enqueue through PgBouncer: %v", err)
		}
		pub.waitIDs(t, want)
		got := pub.publishedIDs()
		for _, id := range want {
			if got[id] != 1 {
				t.Fatalf("message %s published %d times", id, got[id])
			}
		}
		if len(got) != len(want) {
			t.Fatalf("%d messages published, %d enqueued", len(got), len(want))
		}
		last := map[string]int{}
		for _, m := range pub.published() {
			var n int
			if _, err := fmt.Sscan(string(m.Payload), &n); err != nil {
				t.Fatal(err)
			}
			if prev, ok := last[string(m.Key)]; ok && n < prev {
				t.Fatalf("key %s: %d published after %d", m.Key, n, prev)
			}
			last[string(m.Key)] = n
		}
	})
}
