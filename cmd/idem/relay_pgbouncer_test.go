package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/internal/testkit/pgbouncer"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// With --postgres through PgBouncer in transaction mode, the relay refuses
// to start and names --direct-postgres; with it, it publishes every row.
func TestRelayThroughPgBouncer(t *testing.T) {
	direct := testenv.Pool(t, 2)
	b := pgbouncer.New(t, pgbouncer.Options{})
	pool := b.Pool(t, 4)
	schema := testenv.Schema(t, direct)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	pg := []string{"--postgres", b.URL(), "--schema", schema}
	if code, _, errOut := runCmd(ctx, t, append([]string{"migrate", "up"}, pg...)...); code != 0 {
		t.Fatalf("migrate up through PgBouncer: %s", errOut)
	}
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "payments"))
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	brokers := cluster.ListenAddrs()[0]
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	const n = 40
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var msgs []outbox.Message
		for i := range n {
			msgs = append(msgs, outbox.Message{Topic: "payments", Key: fmt.Appendf(nil, "c%d", i%5), Payload: fmt.Appendf(nil, "%d", i)})
		}
		_, err := ob.Enqueue(ctx, tx, msgs...)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	relay := []string{"relay", "--kafka", brokers, "--poll", "50ms", "--log-level", "error"}

	code, _, errOut := runCmd(ctx, t, append(relay, pg...)...)
	if code != 1 || !strings.Contains(errOut, "--direct-postgres") || !strings.Contains(errOut, "pool_mode=transaction") {
		t.Fatalf("relay through PgBouncer: exit %d, %s; want 1 and an error naming --direct-postgres", code, errOut)
	}

	rctx, rcancel := context.WithCancel(ctx)
	var (
		wg  sync.WaitGroup
		out string
	)
	wg.Go(func() {
		code, _, out = runCmd(rctx, t, append(relay, append(pg, "--direct-postgres", testenv.PostgresURL())...)...)
	})
	testenv.Eventually(t, 30*time.Second, "the relay to publish every row", func() bool {
		pending, _, err := ob.Backlog(ctx)
		return err == nil && pending == 0
	})
	rcancel()
	wg.Wait()
	if code != 0 {
		t.Fatalf("relay with --direct-postgres: exit %d: %s", code, out)
	}
}
