package idemnats_test

import (
	"cmp"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	idemnats "github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/outbox"
)

// The services the examples run on.
var (
	exampleNATSURL     = cmp.Or(os.Getenv("IDEM_TEST_NATS_URL"), "nats://127.0.0.1:4222")
	examplePostgresURL = cmp.Or(os.Getenv("IDEM_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
)

// exampleStream creates a stream ORDERS_<random> that stores
// "<name>.orders.>", and returns its name and a cleanup.
func exampleStream(ctx context.Context, js jetstream.JetStream) (string, func(), error) {
	name := "ORDERS_" + strings.ToUpper(rand.Text()[:8])
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".orders.>"}})
	return name, func() {
		_ = js.DeleteStream(context.Background(), name)
		_ = js.DeleteStream(context.Background(), name+"-dlq")
	}, err
}

// A payment worker on a JetStream stream: consumer.Transactional on
// pgtable writes the payment and the message's claim in one transaction,
// and the Consumer acknowledges the message only after that committed. The
// producer publishes order-1 twice with the same Nats-Msg-Id: the stream
// drops the second copy within its duplicate window, and a copy that came
// later would find the claim.
func ExampleNewConsumer() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	nc, err := nats.Connect(exampleNATSURL, nats.MaxReconnects(-1))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		fmt.Println(err)
		return
	}
	pool, err := pgxpool.New(ctx, examplePostgresURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	stream, cleanup, err := exampleStream(ctx, js)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cleanup()
	schema := strings.ToLower(stream)
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema+"; CREATE TABLE "+schema+".payments (order_id text, amount text)"); err != nil {
		fmt.Println(err)
		return
	}
	defer func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") }()

	store, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := store.Migrate(ctx); err != nil { // creates processed_events
		fmt.Println(err)
		return
	}
	charge, err := consumer.Transactional(store, consumer.TxOptions{Scope: "billing/charge"},
		func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+schema+".payments VALUES ($1, $2)", msg.ID, string(msg.Payload))
			return err // an error rolls back the claim too: the retry charges
		})
	if err != nil {
		fmt.Println(err)
		return
	}
	c, err := idemnats.NewConsumer(js, stream, "billing", consumer.Chain(charge, consumer.Recover()), idemnats.ConsumerOptions{})
	if err != nil {
		fmt.Println(err)
		return
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	<-c.Ready()

	for range 2 {
		ack, err := js.PublishMsg(ctx, &nats.Msg{Subject: stream + ".orders.created", Data: []byte("42.00"),
			Header: nats.Header{nats.MsgIdHdr: []string{"order-1"}}})
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Println("stored again:", ack.Duplicate)
	}
	for c.Stats().Acked < 1 {
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	if err := <-done; err != nil {
		fmt.Println(err)
	}
	var n int
	_ = pool.QueryRow(ctx, "SELECT count(*) FROM "+schema+".payments").Scan(&n)
	fmt.Println("payments:", n)
	// Output:
	// stored again: false
	// stored again: true
	// payments: 1
}

// A program that keeps its own JetStream loop maps each message with
// NewMessage, runs its idem chain with consumer.Process and settles the
// message as the Result says.
func ExampleNewMessage() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	nc, err := nats.Connect(exampleNATSURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		fmt.Println(err)
		return
	}
	stream, cleanup, err := exampleStream(ctx, js)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cleanup()
	for _, id := range []string{"order-7", ""} { // the second has no id
		m := &nats.Msg{Subject: stream + ".orders.created", Data: []byte("7.00"), Header: nats.Header{}}
		if id != "" {
			m.Header.Set(nats.MsgIdHdr, id)
		}
		if _, err := js.PublishMsg(ctx, m); err != nil {
			fmt.Println(err)
			return
		}
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{Durable: "own-loop", AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		fmt.Println(err)
		return
	}
	h := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		fmt.Printf("handled %s: %s\n", msg.ID, msg.Payload)
		return nil
	})
	batch, err := cons.Fetch(2, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		fmt.Println(err)
		return
	}
	for m := range batch.Messages() {
		msg, err := idemnats.NewMessage(m, idemnats.MessageOptions{})
		r := consumer.Result{Action: consumer.ActionDeadLetter, Reason: consumer.OutcomeInvalidKey, Err: err}
		if err == nil {
			r = consumer.Process(ctx, h, msg)
		}
		switch r.Action {
		case consumer.ActionAck:
			err = m.DoubleAck(ctx)
		case consumer.ActionDeadLetter:
			fmt.Println("dead letter:", r.Reason, errors.Is(r.Err, dedup.ErrInvalidKey))
			err = m.Term() // after publishing it to a dead-letter subject
		default:
			err = m.NakWithDelay(time.Second)
		}
		if err != nil {
			fmt.Println(err)
		}
	}
	// Output:
	// handled order-7: 7.00
	// dead letter: invalid_key true
}

// An outbox relay publishes through NewPublisher: each message's outbox
// id is its Nats-Msg-Id, so a relay that publishes a batch again after a
// crash stores nothing twice within the stream's duplicate window.
func ExampleNewPublisher() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	nc, err := nats.Connect(exampleNATSURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		fmt.Println(err)
		return
	}
	stream, cleanup, err := exampleStream(ctx, js)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cleanup()
	pub, err := idemnats.NewPublisher(js, idemnats.PublisherOptions{ExpectStream: stream})
	if err != nil {
		fmt.Println(err)
		return
	}
	batch := []*outbox.Message{
		{ID: "0190f1c2-0001", Topic: stream + ".orders.created", Key: []byte("customer-1"), Payload: []byte(`{"order":1}`)},
		{ID: "0190f1c2-0002", Topic: stream + ".orders.created", Key: []byte("customer-1"), Payload: []byte(`{"order":2}`)},
	}
	for range 2 { // the second time as a relay that crashed before marking the rows
		if err := pub.Publish(ctx, batch); err != nil {
			fmt.Println(err)
			return
		}
	}
	info, err := js.Stream(ctx, stream)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("published %d, duplicates dropped %d, stored %d\n", pub.Stats().Published, pub.Stats().Duplicates, info.CachedInfo().State.Msgs)
	// Output:
	// published 4, duplicates dropped 2, stored 2
}
