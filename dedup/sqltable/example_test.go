package sqltable_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"

	_ "modernc.org/sqlite" // the SQLite driver of this example

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/sqltable"
)

// A payment processed twice: the second delivery does not charge again and
// gets the first one's receipt. The store runs here on SQLite, which needs
// no server; with PostgreSQL or MySQL only sql.Open and the dialect change.
func Example() {
	dir, err := os.MkdirTemp("", "sqltable-example")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer func() { _ = os.RemoveAll(dir) }()
	db, err := sql.Open("sqlite", "file:"+filepath.Join(dir, "app.db")+
		"?_txlock=immediate&_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer func() { _ = db.Close() }()

	ctx := context.Background()
	store, err := sqltable.New(db, sqltable.SQLite, sqltable.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := store.Migrate(ctx); err != nil {
		fmt.Println(err)
		return
	}
	if _, err := db.ExecContext(ctx, "CREATE TABLE charges (order_id TEXT, amount INTEGER)"); err != nil {
		fmt.Println(err)
		return
	}

	charge := func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
		if _, err := tx.ExecContext(ctx, "INSERT INTO charges VALUES (?, ?)", "order-42", 100); err != nil {
			return nil, err
		}
		return []byte("receipt-1"), nil
	}
	key := dedup.NewKey("payments", "order-42", []byte(`{"amount":100}`))
	for range 2 {
		receipt, err := store.Process(ctx, key, charge)
		if stored, dup := dedup.StoredResult(err); dup {
			fmt.Printf("duplicate, receipt %s\n", stored)
			continue
		}
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Printf("charged, receipt %s\n", receipt)
	}
	var n int
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM charges").Scan(&n); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("charges:", n)
	// Output:
	// charged, receipt receipt-1
	// duplicate, receipt receipt-1
	// charges: 1
}
