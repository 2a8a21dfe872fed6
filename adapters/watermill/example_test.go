package idemwatermill_test

import (
	"github.com/jackc/pgx/v5"

	"context"
	"errors"
	"fmt"
	"log"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// runRouter starts router and returns a function that closes it and waits
// for Run to return.
func runRouter(router *message.Router) (stop func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := router.Run(context.Background()); err != nil {
			log.Print(err)
		}
	}()
	<-router.Running()
	return func() {
		_ = router.Close()
		<-done
	}
}

// A handler that fails once: Watermill's Retry middleware runs it again, and
// idem lets the retry through because the failed attempt released its claim.
// The broker's redelivery of the same message is acknowledged without
// running the handler.
func ExampleDedup() {
	store, err := memstore.New(memstore.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()
	dedup, err := idemwatermill.Dedup(store, idemwatermill.Options{
		Telemetry: consumer.Telemetry{
			OnOutcome: func(_ context.Context, r consumer.Report) {
				if r.Outcome == consumer.OutcomeDuplicate {
					fmt.Println("duplicate of", r.Key.ID, "acknowledged, handler not run")
				}
			},
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}

	// Publish returns once the subscribers acknowledged the message.
	pubSub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, wm.NopLogger{})
	defer pubSub.Close()
	router, err := message.NewRouter(message.RouterConfig{}, wm.NopLogger{})
	if err != nil {
		fmt.Println(err)
		return
	}
	router.AddMiddleware(
		middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}.Middleware,
		dedup, // inside Retry: each attempt claims again
	)
	attempt := 0
	router.AddConsumerHandler("charge-card", "payments", pubSub, func(msg *message.Message) error {
		attempt++
		if attempt == 1 {
			fmt.Println("charging", string(msg.Payload), "failed: gateway timeout")
			return errors.New("gateway timeout")
		}
		fmt.Println("charged", string(msg.Payload))
		return nil
	})
	stop := runRouter(router)
	defer stop()

	msg := message.NewMessage("pay-42", []byte("100 EUR"))
	if err := pubSub.Publish("payments", msg); err != nil {
		fmt.Println(err)
		return
	}
	if err := pubSub.Publish("payments", msg.Copy()); err != nil { // delivered again
		fmt.Println(err)
		return
	}
	// Output:
	// charging 100 EUR failed: gateway timeout
	// charged 100 EUR
	// duplicate of pay-42 acknowledged, handler not run
}

// A message that reuses a processed UUID with other content goes to
// Watermill's poison queue, with idem's reason in its metadata; the handler
// never sees it.
func ExampleOptions_poisonQueue() {
	store, err := memstore.New(memstore.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()
	pubSub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, wm.NopLogger{})
	defer pubSub.Close()

	poisonQueue, err := middleware.PoisonQueue(pubSub, "payments.poison")
	if err != nil {
		fmt.Println(err)
		return
	}
	dedup, err := idemwatermill.Dedup(store, idemwatermill.Options{PoisonQueue: poisonQueue})
	if err != nil {
		fmt.Println(err)
		return
	}
	router, err := message.NewRouter(message.RouterConfig{}, wm.NopLogger{})
	if err != nil {
		fmt.Println(err)
		return
	}
	router.AddConsumerHandler("charge-card", "payments", pubSub, func(msg *message.Message) error {
		fmt.Println("charged", string(msg.Payload))
		return nil
	}).AddMiddleware(dedup)
	router.AddConsumerHandler("poison-log", "payments.poison", pubSub, func(msg *message.Message) error {
		fmt.Println("poison:", msg.UUID, string(msg.Payload), msg.Metadata.Get(consumer.HeaderReason),
			"from", msg.Metadata.Get(middleware.PoisonedHandlerKey))
		return nil
	})
	stop := runRouter(router)
	defer stop()

	for _, m := range []*message.Message{
		message.NewMessage("pay-42", []byte("100 EUR")),
		message.NewMessage("pay-42", []byte("900 EUR")), // same id, other content
	} {
		if err := pubSub.Publish("payments", m); err != nil {
			fmt.Println(err)
			return
		}
	}
	// Output:
	// charged 100 EUR
	// poison: pay-42 900 EUR fingerprint_mismatch from charge-card
}

// The transactional mode on PostgreSQL: the handler writes through the
// claim's transaction and returns a message, which is written to the outbox
// in the same transaction. Claim, order row and outgoing message commit
// together, or none of them does and the retry runs the handler again.
func ExampleTransactional() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/test")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	store, err := pgtable.New(pool, pgtable.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	ob, err := pgoutbox.New(pool, pgoutbox.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := store.Migrate(ctx); err != nil {
		fmt.Println(err)
		return
	}
	if err := ob.Migrate(ctx); err != nil {
		fmt.Println(err)
		return
	}
	tx, err := idemwatermill.Transactional(store, idemwatermill.Options{Outbox: ob})
	if err != nil {
		fmt.Println(err)
		return
	}

	pubSub := gochannel.NewGoChannel(gochannel.Config{}, wm.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, wm.NopLogger{})
	if err != nil {
		fmt.Println(err)
		return
	}
	router.AddMiddleware(middleware.Recoverer, tx)
	// The publish topic names the outbox messages' topic; the router
	// itself publishes nothing.
	router.AddHandler("place-order", "orders", pubSub, "orders.placed", pubSub, func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := idemwatermill.Tx[pgx.Tx](ctx).Exec(ctx, "INSERT INTO orders (id, body) VALUES ($1, $2)", msg.UUID, msg.Payload); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(wm.NewUUID(), msg.Payload)}, nil
	})
	// A relay publishes the committed outbox rows to Watermill.
	pub, err := idemwatermill.NewPublisher(pubSub)
	if err != nil {
		fmt.Println(err)
		return
	}
	relay, err := pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{})
	if err != nil {
		fmt.Println(err)
		return
	}
	go func() { _ = relay.Run(ctx) }()
	_ = router.Run(ctx)
}
