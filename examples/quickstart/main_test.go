package main

import (
	"context"
	"testing"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestQuickstartInMemory(t *testing.T) {
	if err := run(context.Background(), "", ""); err != nil {
		t.Fatal(err)
	}
}

func TestQuickstartPostgres(t *testing.T) {
	pool := testenv.Pool(t, 1) // skips, or fails under CI=true, when PostgreSQL is down
	schema := testenv.Schema(t, pool)
	if err := run(context.Background(), testenv.PostgresURL(), schema); err != nil {
		t.Fatal(err)
	}
}
