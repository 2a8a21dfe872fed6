package walrelay_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

// printPublisher stands in for a broker adapter (adapters/amqp,
// adapters/kafka): it prints what it is given and confirms it.
type printPublisher struct {
	mu   sync.Mutex
	seen int
	done chan struct{}
}

func (p *printPublisher) Publish(_ context.Context, msgs []*outbox.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		fmt.Printf("published to %s, key %s: %s\n", m.Topic, m.Key, m.Payload)
		if p.seen++; p.seen == 2 {
			close(p.done)
		}
	}
	return nil
}

// An order's events are written in the order's transaction as a logical
// decoding message, with no outbox row; the relay streams them from the
// slot once the transaction commits and publishes them in commit order.
// The events of a rolled-back transaction are never published.
//
// The example runs on the throwaway PostgreSQL with wal_level = logical
// that the package's tests start.
func Example() {
	url, err := startCluster()
	if err != nil {
		fmt.Println(err)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	schema := "idem_example_" + strings.ToLower(rand.Text())
	ob, err := walrelay.New(pool, walrelay.Options{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	// Checks wal_level and the privileges, creates the dead table, the
	// publication and the replication slot.
	if err := ob.Migrate(ctx); err != nil {
		fmt.Println(err)
		return
	}
	defer func() {
		_ = ob.DropSlot(context.Background()) // the relay stopped: the slot is free
		_, _ = pool.Exec(context.Background(), "DROP PUBLICATION "+pgx.Identifier{ob.Options().Publication}.Sanitize())
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	}()

	pub := &printPublisher{done: make(chan struct{})}
	relay, err := walrelay.NewRelay(ob, pub, walrelay.RelayOptions{})
	if err != nil {
		fmt.Println(err)
		return
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(rctx) }()
	defer stop()

	// A rolled-back order: its event is never published.
	_ = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := ob.Enqueue(ctx, tx, outbox.Message{Topic: "orders", Key: []byte("order-0"), Payload: []byte("created")}); err != nil {
			return err
		}
		return fmt.Errorf("payment declined")
	})
	// A committed one: both events, in order.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := ob.Enqueue(ctx, tx,
			outbox.Message{Topic: "orders", Key: []byte("order-1"), Payload: []byte("created")},
			outbox.Message{Topic: "orders", Key: []byte("order-1"), Payload: []byte("paid")})
		return err
	})
	if err != nil {
		fmt.Println(err)
		stop()
		<-done
		return
	}
	select {
	case <-pub.done:
	case <-ctx.Done():
		fmt.Println("timed out")
	}
	stop() // reports the confirmed position before returning
	if err := <-done; err != nil {
		fmt.Println(err)
	}
	// Output:
	// published to orders, key order-1: created
	// published to orders, key order-1: paid
}
