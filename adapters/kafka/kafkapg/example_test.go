package kafkapg_test

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/adapters/kafka/kafkapg"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
)

// Positions written in the transaction of the effect: a position only moves
// forward, so a late write from a member that lost the partition in a
// rebalance cannot move it back.
func ExampleOffsets() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("IDEM_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	var b [4]byte
	_, _ = rand.Read(b[:])
	schema := "idem_example_" + hex.EncodeToString(b[:])
	defer func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+schema+" CASCADE") }()

	offsets, err := kafkapg.NewOffsets(pool, kafkapg.OffsetsOptions{Schema: schema})
	if err != nil {
		panic(err)
	}
	if err := offsets.Migrate(ctx); err != nil {
		panic(err)
	}
	for _, off := range []int64{42, 17} { // 17 arrives late, from the old owner
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			// ... the effect and the pgtable claim go here, in tx ...
			return offsets.SaveTx(ctx, tx, idemkafka.Position{Group: "billing", Topic: "payments", Partition: 0, Offset: off})
		})
		if err != nil {
			panic(err)
		}
	}
	got, err := offsets.LoadOffsets(ctx, "billing", "payments", []int{0, 1})
	if err != nil {
		panic(err)
	}
	_, known := got[1]
	fmt.Println("partition 0 resumes at", got[0])
	fmt.Println("partition 1 has a stored position:", known)
	// Output:
	// partition 0 resumes at 42
	// partition 1 has a stored position: false
}

// A batch's effects written with one statement: the handler gets the records
// the batch claimed first, and a redelivered batch reaches it without the
// records already done.
func ExampleBatchAll() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("IDEM_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	var b [4]byte
	_, _ = rand.Read(b[:])
	schema := "idem_example_" + hex.EncodeToString(b[:])
	defer func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+schema+" CASCADE") }()

	claims, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		panic(err)
	}
	if err := claims.Migrate(ctx); err != nil {
		panic(err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+schema+".payments (id text PRIMARY KEY, body bytea)"); err != nil {
		panic(err)
	}
	insert := "INSERT INTO " + schema + ".payments (id, body) SELECT * FROM unnest($1::text[], $2::bytea[])"
	bh, err := kafkapg.BatchAll(pool, claims, kafkapg.BatchOptions{Scope: "billing/payments"},
		func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
			ids, bodies := make([]string, len(msgs)), make([][]byte, len(msgs))
			for i, m := range msgs {
				ids[i], bodies[i] = m.ID, m.Payload
			}
			fmt.Println("writing", ids)
			_, err := tx.Exec(ctx, insert, ids, bodies)
			return err
		})
	if err != nil {
		panic(err)
	}
	// Under a Consumer: idemkafka.NewBatchConsumer(readerConfig, bh, opts).
	msg := func(id string) *consumer.Message { return &consumer.Message{ID: id, Payload: []byte("{}")} }
	if err := bh(ctx, []*consumer.Message{msg("p-1"), msg("p-2")}); err != nil {
		panic(err)
	}
	err = bh(ctx, []*consumer.Message{msg("p-1"), msg("p-2"), msg("p-3")}) // redelivered, and one more
	var be *idemkafka.BatchError
	if errors.As(err, &be) {
		fmt.Println("duplicates acknowledged:", len(be.Errs))
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+schema+".payments").Scan(&n); err != nil {
		panic(err)
	}
	fmt.Println("payments:", n)
	// Output:
	// writing [p-1 p-2]
	// writing [p-3]
	// duplicates acknowledged: 2
	// payments: 3
}

// A consumer whose duplicates can only be broker redeliveries (its
// producer is idempotent and never sends a message twice) claims each batch
// by its position alone: one UPDATE per batch, no row per message.
func ExampleOffsetsOnly() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("IDEM_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	offsets, err := kafkapg.NewOffsets(pool, kafkapg.OffsetsOptions{})
	if err != nil {
		panic(err)
	}
	if err := offsets.Migrate(ctx); err != nil {
		panic(err)
	}
	bh, err := kafkapg.OffsetsOnly(pool, offsets, kafkapg.OffsetsOnlyOptions{Scope: "metrics/ingest"},
		func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
			ids, bodies := make([]string, len(msgs)), make([][]byte, len(msgs))
			for i, m := range msgs {
				ids[i], bodies[i] = m.ID, m.Payload
			}
			_, err := tx.Exec(ctx, "INSERT INTO samples (id, body) SELECT * FROM unnest($1::text[], $2::bytea[])", ids, bodies)
			return err
		})
	if err != nil {
		panic(err)
	}
	c, err := idemkafka.NewBatchConsumer(kafkago.ReaderConfig{Brokers: []string{"localhost:9092"}, GroupID: "metrics", Topic: "samples"},
		bh, idemkafka.ConsumerOptions{Offsets: offsets, DeadLetterTopic: "samples.dlq"})
	if err != nil {
		panic(err)
	}
	_ = c.Run(ctx)
}
