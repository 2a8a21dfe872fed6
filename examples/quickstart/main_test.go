package main

import (
	"context"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestQuickstartInMemory(t *testing.T) {
	if err := run(context.Background(), "", "", false); err != nil {
		t.Fatal(err)
	}
}

func TestQuickstartPostgres(t *testing.T) {
	pool := testenv.Pool(t, 1) // skips, or fails under CI=true, when PostgreSQL is down
	schema := testenv.Schema(t, pool)
	if err := run(context.Background(), testenv.PostgresURL(), schema, false); err != nil {
		t.Fatal(err)
	}
}

// TestQuickstartCleansUp runs the example without -schema: it makes a
// schema of its own and drops it at the end.
func TestQuickstartCleansUp(t *testing.T) {
	pool := testenv.Pool(t, 1)
	schemas := func() []string {
		t.Helper()
		rows, _ := pool.Query(context.Background(), `SELECT nspname FROM pg_namespace WHERE nspname LIKE 'idem\_quickstart%' ORDER BY 1`)
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return names
	}
	before := schemas()
	if err := run(context.Background(), testenv.PostgresURL(), "", false); err != nil {
		t.Fatal(err)
	}
	if after := schemas(); !slices.Equal(after, before) {
		t.Errorf("schemas idem_quickstart* before the run %v, after %v: the run left its schema behind", before, after)
	}
}
