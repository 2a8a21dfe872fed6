package sqloutbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

	_ "modernc.org/sqlite"

	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/sqloutbox"
)

// printPublisher stands for a broker adapter (adapters/amqp, adapters/kafka):
// it prints what it publishes.
type printPublisher struct{ sent chan struct{} }

func (p printPublisher) Publish(_ context.Context, msgs []*outbox.Message) error {
	for _, m := range msgs {
		fmt.Printf("published to %s, key %s: %s (attempt %d)\n", m.Topic, m.Key, m.Payload, m.Attempt)
	}
	p.sent <- struct{}{}
	return nil
}

// An order and its event are written in one transaction on SQLite; the
// relay publishes the event after commit. On MySQL or MariaDB the code is
// the same with sqloutbox.MySQL, and several relays may run at once.
func Example() {
	dir, err := os.MkdirTemp("", "sqloutbox-example")
	if err != nil {
		log.Fatal(err)
	}
	err = shop(context.Background(), filepath.Join(dir, "shop.db"))
	_ = os.RemoveAll(dir)
	if err != nil {
		log.Fatal(err)
	}
	// Output:
	// published to orders, key o-42: {"total":100} (attempt 1)
	// pending: 0
}

func shop(ctx context.Context, path string) error {
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(5000)&_pragma=journal_mode(WAL)")
	if err != nil {
		return err
	}
	defer func() { _ = db.Close() }()
	if _, err := db.ExecContext(ctx, "CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER)"); err != nil {
		return err
	}

	ob, err := sqloutbox.New(db, sqloutbox.SQLite, sqloutbox.Options{})
	if err != nil {
		return err
	}
	if err := ob.Migrate(ctx); err != nil {
		return err
	}

	// The business write and its message commit together, or neither does.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, "INSERT INTO orders (id, total) VALUES ('o-42', 100)"); err != nil {
		return err
	}
	if _, err := ob.Enqueue(ctx, tx, outbox.Message{Topic: "orders", Key: []byte("o-42"), Payload: []byte(`{"total":100}`)}); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return err
	}

	pub := printPublisher{sent: make(chan struct{}, 1)}
	relay, err := sqloutbox.NewRelay(ob, pub, sqloutbox.RelayOptions{PollInterval: 50 * time.Millisecond})
	if err != nil {
		return err
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(runCtx) }()
	<-pub.sent
	stop()
	if err := <-done; err != nil {
		return err
	}
	pending, _, err := ob.Backlog(ctx)
	if err != nil {
		return err
	}
	fmt.Println("pending:", pending)
	return nil
}
