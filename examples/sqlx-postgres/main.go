// Command sqlx-postgres is a consumer whose business write goes through sqlx
// on PostgreSQL (database/sql with pgx's stdlib driver) and commits in one
// transaction with idem's claim (dedup/sqltable, Postgres dialect). Every
// message is delivered twice, one first delivery fails after its write and is
// redelivered: each order must be written exactly once. See README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"regexp"
	"sync"
	"sync/atomic"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/sqltable"
)

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "sqlx-postgres:", err)
		os.Exit(1)
	}
}

// sqlxStore is sqltable's transactional store with sqlx's transaction type:
// the transaction is begun by sqlx (a *sqlx.Tx, which embeds the *sql.Tx)
// and the key is claimed in it with ClaimTx, as the transaction's first
// statement. consumer.Transactional takes any dedup.TxStore, so handlers get
// the *sqlx.Tx.
type sqlxStore struct {
	db    *sqlx.DB
	store *sqltable.Store
}

// Process implements dedup.TxStore[*sqlx.Tx].
func (s sqlxStore) Process(ctx context.Context, key dedup.Key, fn dedup.TxFunc[*sqlx.Tx]) ([]byte, error) {
	tx, err := s.db.BeginTxx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback() }() // sql.ErrTxDone after Commit
	if err := s.store.ClaimTx(ctx, tx.Tx, key); err != nil {
		return nil, err // a duplicate, a conflict or a database error: fn does not run
	}
	result, err := fn(ctx, tx)
	if err != nil {
		return nil, err
	}
	if result != nil {
		if err := s.store.SetResultTx(ctx, tx.Tx, key, result); err != nil {
			return nil, err
		}
	}
	return result, tx.Commit()
}

// Order is the business row. order_id has no unique index on purpose: the
// table is the oracle, a duplicate effect would show as two rows.
type Order struct {
	OrderID string `db:"order_id"`
	Amount  int64  `db:"amount"`
}

var namePattern = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,40}$`)

func run(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("sqlx-postgres", flag.ContinueOnError)
	fs.SetOutput(out)
	printf := func(format string, a ...any) { _, _ = fmt.Fprintf(out, format, a...) }
	url := fs.String("postgres", envOr("IDEM_EXAMPLE_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"),
		"PostgreSQL URL (env IDEM_EXAMPLE_POSTGRES_URL)")
	n := fs.Int("orders", 20, "number of orders; each is delivered twice")
	workers := fs.Int("workers", 4, "deliveries handled at once")
	schema := fs.String("schema", "", "schema of the tables, created if absent (default idem_example_sqlx_<random>, dropped at the end)")
	keep := fs.Bool("keep", false, "keep the schema at the end")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *n < 2 || *workers < 1 {
		return errors.New("-orders must be at least 2 and -workers at least 1")
	}
	own := *schema == ""
	if own {
		*schema = fmt.Sprintf("idem_example_sqlx_%06x", rand.Uint32()&0xffffff)
	}
	if !namePattern.MatchString(*schema) {
		return fmt.Errorf("-schema %q: use lowercase letters, digits and _ (at most 41)", *schema)
	}
	orders := `"` + *schema + `".orders`

	db, err := sqlx.Open("pgx", *url)
	if err != nil {
		return err
	}
	defer func() { _ = db.Close() }()
	pingCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := db.PingContext(pingCtx); err != nil {
		return fmt.Errorf("PostgreSQL at %s is unreachable: %w (start it with `make up`, or pass -postgres)", *url, err)
	}
	if _, err := db.ExecContext(ctx, `CREATE SCHEMA IF NOT EXISTS "`+*schema+`"`); err != nil {
		return err
	}
	if own && !*keep {
		defer func() {
			_, _ = db.ExecContext(context.WithoutCancel(ctx), `DROP SCHEMA IF EXISTS "`+*schema+`" CASCADE`)
		}()
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+orders+` (order_id text NOT NULL, amount bigint NOT NULL)`); err != nil {
		return err
	}
	store, err := sqltable.New(db.DB, sqltable.Postgres, sqltable.Options{Schema: *schema})
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	printf("schema %s: orders (sqlx) and %s (idem claims)\n", *schema, store.Table())

	// The order whose first delivery fails after sqlx wrote it: its
	// transaction rolls back, the claim with it, and the redelivery writes
	// it once.
	failing := fmt.Sprintf("order-%03d", *n/2)
	var failedOnce atomic.Bool

	handler, err := consumer.Transactional[*sqlx.Tx](sqlxStore{db: db, store: store}, consumer.TxOptions{Scope: "billing.orders"},
		func(ctx context.Context, tx *sqlx.Tx, msg *consumer.Message) error {
			order := Order{OrderID: msg.ID, Amount: int64(len(msg.Payload)) * 100}
			if _, err := tx.NamedExecContext(ctx, `INSERT INTO `+orders+` (order_id, amount) VALUES (:order_id, :amount)`, order); err != nil {
				return err
			}
			if msg.ID == failing && failedOnce.CompareAndSwap(false, true) {
				return errors.New("payment service timed out (after the order row was written)")
			}
			return nil
		})
	if err != nil {
		return err
	}

	// The message source: every order delivered twice, in shuffled order,
	// by several workers at once, as a broker redelivers after a lost ACK.
	// A delivery that is not acknowledged goes back on the queue.
	var deliveries []*consumer.Message
	for i := 1; i <= *n; i++ {
		id := fmt.Sprintf("order-%03d", i)
		for range 2 {
			deliveries = append(deliveries, &consumer.Message{ID: id, Payload: []byte(`{"order":"` + id + `"}`)})
		}
	}
	rand.Shuffle(len(deliveries), func(i, j int) { deliveries[i], deliveries[j] = deliveries[j], deliveries[i] })
	queue := make(chan *consumer.Message, 2*len(deliveries))
	for _, m := range deliveries {
		queue <- m
	}
	var applied, dropped, redelivered, pending atomic.Int64
	pending.Store(int64(len(deliveries)))
	runCtx, stop := context.WithTimeout(ctx, 2*time.Minute)
	defer stop()
	var wg sync.WaitGroup
	var firstErr error
	var errOnce sync.Once
	for range *workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for pending.Load() > 0 {
				var m *consumer.Message
				select {
				case m = <-queue:
				case <-runCtx.Done():
					errOnce.Do(func() { firstErr = fmt.Errorf("deliveries still pending: %w", runCtx.Err()) })
					return
				case <-time.After(50 * time.Millisecond):
					continue
				}
				r := consumer.Process(runCtx, handler, m)
				switch {
				case r.Action == consumer.ActionAck && r.Duplicate:
					dropped.Add(1)
					pending.Add(-1)
				case r.Action == consumer.ActionAck:
					applied.Add(1)
					pending.Add(-1)
				case r.Action == consumer.ActionRetry:
					printf("%s: %v: not acknowledged, delivered again\n", m.ID, r.Err)
					redelivered.Add(1)
					queue <- m
				default:
					errOnce.Do(func() { firstErr = fmt.Errorf("%s: %s: %w", m.ID, r.Reason, r.Err) })
					pending.Add(-1)
				}
			}
		}()
	}
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}

	// The oracle: orders written more than once, and orders never written.
	var dupRows []struct {
		OrderID string `db:"order_id"`
		N       int    `db:"n"`
	}
	if err := db.SelectContext(ctx, &dupRows, `SELECT order_id, count(*) AS n FROM `+orders+` GROUP BY order_id HAVING count(*) > 1 ORDER BY order_id`); err != nil {
		return err
	}
	var distinct int
	if err := db.GetContext(ctx, &distinct, `SELECT count(DISTINCT order_id) FROM `+orders); err != nil {
		return err
	}
	printf("%d deliveries of %d orders: %d applied, %d duplicates dropped, %d redelivered after a rollback\n",
		len(deliveries), *n, applied.Load(), dropped.Load(), redelivered.Load())
	if len(dupRows) > 0 {
		return fmt.Errorf("duplicate effect: %d orders written more than once, such as %s (%d rows)", len(dupRows), dupRows[0].OrderID, dupRows[0].N)
	}
	if distinct != *n {
		return fmt.Errorf("lost effect: %d of %d orders written", distinct, *n)
	}
	printf("every order written exactly once (%d of %d)\n", distinct, *n)
	return nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
