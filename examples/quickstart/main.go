// Command quickstart shows idem's consumer pipeline catching duplicate
// deliveries of payment messages.
//
// With no flags it needs no server: a lease store in memory (memstore) guards
// a "charge the card" side effect. With -postgres it uses pgtable instead, and
// the charge is a row written in the same transaction as the claim.
//
//	go run ./examples/quickstart
//	go run ./examples/quickstart -postgres postgres://postgres@127.0.0.1:5432/test
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/dedup/pgtable"
)

func main() {
	pgURL := flag.String("postgres", "", "PostgreSQL URL; empty runs everything in memory")
	schema := flag.String("schema", "", "schema for the -postgres tables, kept at the end (default: a fresh idem_quickstart_<random>, dropped at the end unless -keep)")
	keep := flag.Bool("keep", false, "keep the fresh schema and its rows at the end")
	flag.Parse()
	if err := run(context.Background(), *pgURL, *schema, *keep); err != nil {
		log.Fatal(err)
	}
}

// deliveries returns what an at-least-once broker hands a consumer: every
// payment once, some twice (a redelivery after a crash before the ACK), one
// three times.
func deliveries() []*consumer.Message {
	var out []*consumer.Message
	for i := 1; i <= 5; i++ {
		msg := &consumer.Message{ID: fmt.Sprintf("pay-%d", i), Payload: []byte(fmt.Sprintf(`{"amount":%d}`, i*100))}
		out = append(out, msg)
		if i%2 == 1 {
			out = append(out, msg) // redelivered
		}
	}
	return append(out, out[0])
}

// run runs the example; with pgURL, in schema, or in a fresh schema that
// is dropped at the end unless keep.
func run(ctx context.Context, pgURL, schema string, keep bool) error {
	var (
		h       consumer.Handler
		charges atomic.Int64
		report  func() error
	)
	if pgURL == "" {
		store, err := memstore.New(memstore.Options{})
		if err != nil {
			return err
		}
		defer func() { _ = store.Close() }()
		dedup, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "billing/charge"})
		if err != nil {
			return err
		}
		charge := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
			charges.Add(1) // the side effect: a call to the payment provider
			return nil
		})
		h = consumer.Chain(charge, consumer.Recover(), dedup)
		report = func() error { return nil }
	} else {
		pool, err := pgxpool.New(ctx, pgURL)
		if err != nil {
			return err
		}
		defer pool.Close()
		if schema == "" {
			schema = fmt.Sprintf("idem_quickstart_%08x", rand.Uint32())
			if !keep {
				defer func() {
					_, _ = pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
				}()
			}
		}
		store, err := pgtable.New(pool, pgtable.Options{Schema: schema})
		if err != nil {
			return err
		}
		if err := store.Migrate(ctx); err != nil {
			return err
		}
		// The schema name passed pgtable's allow-list check in New.
		chargesTable := pgx.Identifier{schema, "charges"}.Sanitize()
		if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+chargesTable+` (payment_id text, amount_json text)`); err != nil {
			return err
		}
		if _, err := pool.Exec(ctx, `TRUNCATE `+chargesTable+`, `+store.Table()); err != nil {
			return err
		}
		h, err = consumer.Transactional(store, consumer.TxOptions{Scope: "billing/charge"},
			func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
				_, err := tx.Exec(ctx, `INSERT INTO `+chargesTable+` VALUES ($1, $2)`, msg.ID, string(msg.Payload))
				if err == nil {
					charges.Add(1)
				}
				return err
			})
		if err != nil {
			return err
		}
		report = func() error {
			var rows int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+chargesTable).Scan(&rows); err != nil {
				return err
			}
			fmt.Printf("rows in %s: %d\n", chargesTable, rows)
			return nil
		}
	}

	msgs := deliveries()
	var acked, duplicates atomic.Int64
	var wg sync.WaitGroup
	for _, msg := range msgs { // concurrent workers, as a broker's competing consumers are
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				res := consumer.Process(ctx, h, msg)
				switch res.Action {
				case consumer.ActionAck:
					acked.Add(1)
					if res.Duplicate {
						duplicates.Add(1)
					}
					return
				case consumer.ActionRetry: // in flight elsewhere: the broker redelivers later
					time.Sleep(time.Millisecond)
				default:
					fmt.Fprintln(os.Stderr, "dead-lettered:", msg.ID, res.Reason, res.Err)
					return
				}
			}
		}()
	}
	wg.Wait()
	fmt.Printf("deliveries: %d, acked: %d, duplicates caught: %d, charges: %d\n",
		len(msgs), acked.Load(), duplicates.Load(), charges.Load())
	if err := report(); err != nil {
		return err
	}
	if charges.Load() != 5 {
		return errors.New("expected exactly 5 charges")
	}
	return nil
}
