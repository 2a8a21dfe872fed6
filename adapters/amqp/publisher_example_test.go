package idemamqp_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// A relay publishing an outbox to RabbitMQ with publisher confirms: each
// message goes to the exchange named by its Topic, with its Key as routing
// key, persistent, with the outbox id as message-id.
func ExampleNewPublisher() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/app")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	ob, err := pgoutbox.New(pool, pgoutbox.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	pub, err := idemamqp.NewPublisher("amqp://guest:guest@127.0.0.1:5672/", idemamqp.PublisherOptions{
		ConfirmTimeout: 5 * time.Second, // not confirmed by then: sent again
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer func() { _ = pub.Close() }()
	// The publisher is safe for concurrent use, so the relay may run two
	// sessions (two batches in flight).
	relay, err := pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{Sessions: 2})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := relay.Run(ctx); err != nil { // until ctx ends
		fmt.Println(err)
	}
}
