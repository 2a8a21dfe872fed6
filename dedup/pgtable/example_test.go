package pgtable_test

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

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
)

// postgresURL is the database the examples run on.
var postgresURL = cmp.Or(os.Getenv("IDEM_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")

// A payment message is delivered twice. Process runs the handler in a
// transaction that also holds the claim, so the charge row and the
// processed_events row commit together; the redelivery finds the claim and
// gets the stored result back without running the handler.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(postgresURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	// A fresh schema per run, dropped at the end.
	schema := "idem_example_" + strings.ToLower(rand.Text())
	defer func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	}()

	store, err := pgtable.New(pool, pgtable.Options{Schema: schema, Retention: 14 * 24 * time.Hour})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := store.Migrate(ctx); err != nil { // creates the schema and processed_events
		fmt.Println(err)
		return
	}
	payments := pgx.Identifier{schema, "payments"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+payments+" (order_id text NOT NULL, amount int NOT NULL)"); err != nil {
		fmt.Println(err)
		return
	}

	payload := []byte(`{"order":"A-1","amount":100}`)
	key := dedup.NewKey("billing-consumer/charge", "order-A-1", payload)
	charge := func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		if _, err := tx.Exec(ctx, "INSERT INTO "+payments+" (order_id, amount) VALUES ($1, $2)", "A-1", 100); err != nil {
			return nil, err
		}
		return []byte("charged 100 for A-1"), nil
	}
	for delivery := 1; delivery <= 2; delivery++ {
		result, err := store.Process(ctx, key, charge)
		if stored, dup := dedup.StoredResult(err); dup {
			fmt.Printf("delivery %d: duplicate, first run said %q\n", delivery, stored)
			continue
		}
		if err != nil { // handler or database error: do not ACK, retry later
			fmt.Printf("delivery %d: %v\n", delivery, err)
			continue
		}
		fmt.Printf("delivery %d: processed, %q\n", delivery, result)
	}

	var rows int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+payments).Scan(&rows); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("payment rows:", rows)
	// Output:
	// delivery 1: processed, "charged 100 for A-1"
	// delivery 2: duplicate, first run said "charged 100 for A-1"
	// payment rows: 1
}

// ClaimTx claims a key inside a transaction the caller already runs, here
// with pgx.BeginFunc. The first delivery fails after its claim: the
// transaction rolls back and the claim with it, so the redelivery runs
// again. The third delivery is a duplicate and changes nothing.
func ExampleStore_ClaimTx() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(postgresURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	schema := "idem_example_" + strings.ToLower(rand.Text())
	defer func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	}()
	store, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := store.Migrate(ctx); err != nil {
		fmt.Println(err)
		return
	}
	stock := pgx.Identifier{schema, "stock"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+stock+" (sku text PRIMARY KEY, n int NOT NULL)"); err != nil {
		fmt.Println(err)
		return
	}
	if _, err := pool.Exec(ctx, "INSERT INTO "+stock+" VALUES ('sku-1', 10)"); err != nil {
		fmt.Println(err)
		return
	}

	key := dedup.NewKey("inventory/reserve", "order-B-2", []byte(`{"sku":"sku-1","n":3}`))
	handle := func(delivery int) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			err := store.ClaimTx(ctx, tx, key)
			if errors.Is(err, dedup.ErrDuplicate) {
				fmt.Printf("delivery %d: duplicate, nothing to do\n", delivery)
				return nil // ACK
			}
			if err != nil {
				return err
			}
			// A relative update, in the same transaction as the claim.
			if _, err := tx.Exec(ctx, "UPDATE "+stock+" SET n = n - 3 WHERE sku = 'sku-1'"); err != nil {
				return err
			}
			if delivery == 1 {
				return errors.New("crashed before commit")
			}
			fmt.Printf("delivery %d: reserved\n", delivery)
			return nil
		})
	}
	for delivery := 1; delivery <= 3; delivery++ {
		if err := handle(delivery); err != nil {
			fmt.Printf("delivery %d: %v (rolled back)\n", delivery, err)
		}
	}

	var n int
	if err := pool.QueryRow(ctx, "SELECT n FROM "+stock+" WHERE sku = 'sku-1'").Scan(&n); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("stock left:", n)
	// Output:
	// delivery 1: crashed before commit (rolled back)
	// delivery 2: reserved
	// delivery 3: duplicate, nothing to do
	// stock left: 7
}

// The lease mode is a dedup.LeaseStore on the same table, for effects outside
// the database, such as a call to a payment provider. Leases and retention
// run on the database clock.
func ExampleStore_Lease() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(postgresURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	schema := "idem_example_" + strings.ToLower(rand.Text())
	defer func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	}()
	store, err := pgtable.New(pool, pgtable.Options{Schema: schema, Lease: time.Minute})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := store.Migrate(ctx); err != nil {
		fmt.Println(err)
		return
	}
	leases := store.Lease()

	key := dedup.NewKey("payments/capture", "pay-17", []byte(`{"amount":100}`))
	lease, err := leases.Claim(ctx, key)
	if err != nil {
		fmt.Println(err)
		return
	}

	// A concurrent redelivery while the provider call runs: do not ACK.
	_, err = leases.Claim(ctx, key)
	fmt.Println("redelivery in flight:", errors.Is(err, dedup.ErrInFlight))

	// The provider call succeeded: mark the key done with its result.
	if err := leases.Complete(ctx, lease, []byte("capture cap_8")); err != nil {
		fmt.Println(err)
		return
	}
	_, err = leases.Claim(ctx, key)
	if result, dup := dedup.StoredResult(err); dup {
		fmt.Printf("later redelivery: duplicate, %s\n", result)
	}
	// The lease is spent: the owner cannot release a completed key.
	fmt.Println("release after complete:", errors.Is(leases.Release(ctx, lease), dedup.ErrLeaseLost))
	// Output:
	// redelivery in flight: true
	// later redelivery: duplicate, capture cap_8
	// release after complete: true
}

// A consumer handles a batch of messages in one transaction: BeginBatch
// claims every key with BEGIN, the effects of the keys claimed first are
// written in one statement, and the consumer's position goes with COMMIT.
// The same batch delivered again finds every key claimed.
func ExampleStore_BeginBatch() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(postgresURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	schema := "idem_example_" + strings.ToLower(rand.Text())
	defer func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	}()
	// The ids are UUIDs of version 7, as idem's outbox writes them:
	// TimeOrderedKeys keeps their order in the table's primary key.
	store, err := pgtable.New(pool, pgtable.Options{Schema: schema, TimeOrderedKeys: true})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := store.Migrate(ctx); err != nil {
		fmt.Println(err)
		return
	}
	ledger := pgx.Identifier{schema, "ledger"}.Sanitize()
	position := pgx.Identifier{schema, "position"}.Sanitize()
	for _, ddl := range []string{
		"CREATE TABLE " + ledger + " (id text PRIMARY KEY, amount int NOT NULL)",
		"CREATE TABLE " + position + " (next bigint NOT NULL)",
		"INSERT INTO " + position + " VALUES (0)",
	} {
		if _, err := pool.Exec(ctx, ddl); err != nil {
			fmt.Println(err)
			return
		}
	}

	ids := []string{"0190f5c2-8a00-7000-8000-000000000001", "0190f5c2-8a00-7000-8000-000000000002", "0190f5c2-8a01-7000-8000-000000000003"}
	handle := func(delivery int) error {
		keys := make([]dedup.Key, len(ids))
		for i, id := range ids {
			keys[i] = dedup.NewKey("ledger/post", id, nil)
		}
		bt, verdicts, err := store.BeginBatch(ctx, pool, keys)
		if err != nil {
			return err
		}
		defer func() { _ = bt.Rollback(ctx) }() // does nothing after Commit
		var fresh []string
		for i, v := range verdicts {
			switch {
			case v == nil:
				fresh = append(fresh, ids[i])
			case !errors.Is(v, dedup.ErrDuplicate):
				return v
			}
		}
		if _, err := bt.Tx().Exec(ctx, "INSERT INTO "+ledger+" (id, amount) SELECT unnest($1::text[]), 100", fresh); err != nil {
			return err
		}
		bt.AtCommit("UPDATE "+position+" SET next = $1", int64(len(ids)))
		if err := bt.Commit(ctx); err != nil {
			return err
		}
		fmt.Printf("delivery %d: %d new, %d duplicates\n", delivery, len(fresh), len(ids)-len(fresh))
		return nil
	}
	for delivery := 1; delivery <= 2; delivery++ {
		if err := handle(delivery); err != nil {
			fmt.Printf("delivery %d: %v\n", delivery, err)
		}
	}
	var rows, next int64
	if err := pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM "+ledger+"), (SELECT next FROM "+position+")").Scan(&rows, &next); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("ledger rows: %d, position: %d\n", rows, next)
	// Output:
	// delivery 1: 3 new, 0 duplicates
	// delivery 2: 0 new, 3 duplicates
	// ledger rows: 3, position: 3
}
