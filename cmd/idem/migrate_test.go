package main

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestMigrate(t *testing.T) {
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	pg := []string{"--postgres", testenv.PostgresURL(), "--schema", schema}

	// Pending migrations: status says so and exits 3, for a deploy check.
	code, out, errOut := runCmd(ctx, t, append([]string{"migrate", "status"}, pg...)...)
	if code != exitPending || strings.Count(out, "not migrated") != 2 {
		t.Fatalf("status before up: exit %d, want %d\n%s%s", code, exitPending, out, errOut)
	}

	// Concurrent ups: the advisory locks make one apply and the others
	// find nothing to do.
	var wg sync.WaitGroup
	codes := make([]int, 4)
	for i := range codes {
		wg.Go(func() { codes[i], _, _ = runCmd(ctx, t, append([]string{"migrate", "up"}, pg...)...) })
	}
	wg.Wait()
	for i, c := range codes {
		if c != 0 {
			t.Fatalf("concurrent up %d: exit %d", i, c)
		}
	}

	// Flags before the action work too; up again is a no-op.
	code, out, errOut = runCmd(ctx, t, append(append([]string{"migrate"}, pg...), "up")...)
	if code != 0 {
		t.Fatalf("up again: exit %d\n%s", code, errOut)
	}
	for _, want := range []string{
		`"` + schema + `"."processed_events" (dedup, pgtable): version 0002_key_digest (2 of 2 applied)`,
		`"` + schema + `"."outbox" (outbox, pgoutbox): version 0001_outbox (1 of 1 applied)`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("status after up:\n%s\nwant a line %q", out, want)
		}
	}
	code, _, errOut = runCmd(ctx, t, append([]string{"migrate", "status"}, pg...)...)
	if code != 0 {
		t.Errorf("status after up: exit %d, want 0\n%s", code, errOut)
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM information_schema.tables WHERE table_schema = $1", schema).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 4 { // two tables and their migration ledgers
		t.Errorf("%d tables in %s, want 4", n, schema)
	}
}

func TestMigrateSQL(t *testing.T) {
	code, out, errOut := runCmd(context.Background(), t, "migrate", "sql", "--schema", "billing")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	for _, want := range []string{
		`CREATE SCHEMA IF NOT EXISTS "billing"`,
		`CREATE TABLE IF NOT EXISTS "billing"."processed_events"`,
		`"billing"."outbox"`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("migrate sql does not contain %q", want)
		}
	}
	// The SQL applies as it is (what a goose or golang-migrate user does).
	pool := testenv.Pool(t, 2)
	schema := testenv.Schema(t, pool)
	_, out, _ = runCmd(context.Background(), t, "migrate", "sql", "--schema", schema)
	if _, err := pool.Exec(context.Background(), out); err != nil {
		t.Fatalf("applying migrate sql: %v", err)
	}
}

// TestMigrateDedupLayoutFlags: --partitioned and --keep-keys give the dedup
// table the layout the application runs with, so that converting an older
// table keeps what the application keeps.
func TestMigrateDedupLayoutFlags(t *testing.T) {
	_, plain, _ := runCmd(context.Background(), t, "migrate", "sql", "--schema", "billing")
	code, out, errOut := runCmd(context.Background(), t, "migrate", "sql", "--schema", "billing", "--partitioned", "--keep-keys")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	if strings.Contains(plain, "PARTITION BY RANGE") || !strings.Contains(out, "PARTITION BY RANGE") {
		t.Errorf("--partitioned: the partitioned layout only with the flag (with: %t, without: %t)",
			strings.Contains(out, "PARTITION BY RANGE"), strings.Contains(plain, "PARTITION BY RANGE"))
	}
	_, kept, _ := runCmd(context.Background(), t, "migrate", "sql", "--schema", "billing", "--keep-keys")
	if !strings.Contains(plain, "scope TYPE text USING NULL") || !strings.Contains(kept, "scope TYPE text USING scope") {
		t.Errorf("--keep-keys: the conversion of an older table keeps scope only with the flag")
	}
	const orderedKey = "[67][0-9a-fA-F]{3}" // the version-6/7 test of the time-ordered key
	_, ordered, _ := runCmd(context.Background(), t, "migrate", "sql", "--schema", "billing", "--time-ordered-keys")
	if strings.Contains(plain, orderedKey) || !strings.Contains(ordered, orderedKey) {
		t.Errorf("--time-ordered-keys: the conversion of an older table keys UUIDv6/v7 ids by their time only with the flag")
	}
	if code, _, _ := runCmd(context.Background(), t, "migrate", "sql", "--driver", "sqlite", "--dsn", "file::memory:", "--time-ordered-keys"); code == 0 {
		t.Errorf("--time-ordered-keys with --driver accepted")
	}
}
