package main

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestExample runs the program on its in-process kfake cluster, as
// `go run ./examples/kafka` does.
func TestExample(t *testing.T) {
	if err := run(config{n: 300, dups: 30, partitions: 2, timeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
}

// TestExamplePostgres runs it with -postgres and no -schema: it makes a
// schema of its own and drops it at the end.
func TestExamplePostgres(t *testing.T) {
	pool := testenv.Pool(t, 1) // skips, or fails under CI=true, when PostgreSQL is down
	schemas := func() []string {
		t.Helper()
		rows, _ := pool.Query(context.Background(), `SELECT nspname FROM pg_namespace WHERE nspname = 'idem_example' OR nspname LIKE 'idem\_example\_kafka\_%' ORDER BY 1`)
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return names
	}
	before := schemas()
	if err := run(config{postgres: testenv.PostgresURL(), n: 300, dups: 30, partitions: 2, timeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	if after := schemas(); !slices.Equal(after, before) {
		t.Errorf("schemas idem_example, idem_example_kafka_* before the run %v, after %v: the run left its schema behind", before, after)
	}
}
