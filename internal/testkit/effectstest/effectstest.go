// Package effectstest is the oracle of the broker adapters' consumer
// tests: in one PostgreSQL schema, the pgtable store that claims the
// messages and an effects table without any unique constraint, where a
// consumer.Transactional handler writes one row per run. A duplicate
// effect shows as a second row of its id, a lost message as no row.
package effectstest

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// Scope is the claims' scope.
const Scope = "test/effects"

// Oracle is a schema with the pgtable store and the effects table.
type Oracle struct {
	Pool   *pgxpool.Pool
	Schema string
	Store  *pgtable.Store
}

// New creates a fresh schema on a pool of maxConns connections, migrates
// the store in it and creates the effects table.
func New(t testing.TB, maxConns int32) *Oracle {
	t.Helper()
	pool := testenv.Pool(t, maxConns)
	schema := testenv.Schema(t, pool)
	o, err := Open(pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := o.Store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+o.Table()+" (id text NOT NULL, attempt int NOT NULL, redelivered bool NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return o
}

// Open returns the oracle of a schema New made, for a child process.
func Open(pool *pgxpool.Pool, schema string) (*Oracle, error) {
	store, err := pgtable.New(pool, pgtable.Options{Schema: schema, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return nil, err
	}
	return &Oracle{Pool: pool, Schema: schema, Store: store}, nil
}

// Table is the effects table, quoted and schema-qualified.
func (o *Oracle) Table() string { return pgx.Identifier{o.Schema, "effects"}.Sanitize() }

// TxHandler is the Transactional handler that writes the effect (the
// message's id, Attempt and Redelivered) in the claim's transaction,
// after before (if set) ran and before after (if set) runs, both inside
// the transaction.
func (o *Oracle) TxHandler(before, after func(ctx context.Context, msg *consumer.Message) error) (consumer.Handler, error) {
	ins := "INSERT INTO " + o.Table() + " (id, attempt, redelivered) VALUES ($1, $2, $3)"
	return consumer.Transactional(o.Store, consumer.TxOptions{Scope: Scope},
		func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			if before != nil {
				if err := before(ctx, msg); err != nil {
					return err
				}
			}
			if _, err := tx.Exec(ctx, ins, msg.ID, msg.Attempt, msg.Redelivered); err != nil {
				return err
			}
			if after != nil {
				return after(ctx, msg)
			}
			return nil
		})
}

// Handler is TxHandler(before, nil); the test fails if it cannot be made.
func (o *Oracle) Handler(t testing.TB, before func(ctx context.Context, msg *consumer.Message) error) consumer.Handler {
	t.Helper()
	h, err := o.TxHandler(before, nil)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// Counts returns the number of effect rows and of distinct ids.
func (o *Oracle) Counts(t testing.TB) (rows, distinct int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := o.Pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT id) FROM "+o.Table()).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	return rows, distinct
}

// Check fails the test unless every id in want has exactly one effect
// row and no other id has any.
func (o *Oracle) Check(t testing.TB, want []string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rows, err := o.Pool.Query(ctx, "SELECT id, count(*) FROM "+o.Table()+" GROUP BY id")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			t.Fatal(err)
		}
		got[id] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	dups, lost := 0, 0
	for _, id := range want {
		switch n := got[id]; {
		case n == 0:
			lost++
		case n > 1:
			dups += n - 1
		}
		delete(got, id)
	}
	if dups > 0 || lost > 0 || len(got) > 0 {
		t.Errorf("%d ids: %d duplicate effects, %d lost, %d unexpected ids", len(want), dups, lost, len(got))
	}
}
