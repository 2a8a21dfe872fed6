package kafkasql_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/adapters/kafka/kafkasql"
)

// Positions written in the transaction of the effect, here on SQLite: a
// position only moves forward, so a late write from a member that lost the
// partition in a rebalance cannot move it back.
func ExampleOffsets() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "kafkasql-example")
	if err != nil {
		panic(err)
	}
	defer func() { _ = os.RemoveAll(dir) }()
	db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "app.db")+"?_txlock=immediate&_pragma=busy_timeout(10000)")
	if err != nil {
		panic(err)
	}
	defer func() { _ = db.Close() }()

	offsets, err := kafkasql.New(db, kafkasql.SQLite, kafkasql.Options{})
	if err != nil {
		panic(err)
	}
	if err := offsets.Migrate(ctx); err != nil {
		panic(err)
	}
	for _, off := range []int64{42, 17} { // 17 arrives late, from the old owner
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			panic(err)
		}
		// ... the effect and the sqltable claim go here, in tx ...
		if err := offsets.SaveTx(ctx, tx, idemkafka.Position{Group: "billing", Topic: "payments", Partition: 0, Offset: off}); err != nil {
			panic(err)
		}
		if err := tx.Commit(); err != nil {
			panic(err)
		}
	}
	// The Consumer loads the positions of the partitions assigned to it.
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
