package kafkapg_test

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"

	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/adapters/kafka/kafkapg"
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
