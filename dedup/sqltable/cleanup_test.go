package sqltable_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestCleanupBoundedBatches: Cleanup deletes the expired rows, and only
// them, in batches smaller than their number.
func TestCleanupBoundedBatches(t *testing.T) {
	t.Parallel()
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			db := b.open(t)
			s := newStore(t, b, db, sqltable.Options{CleanupBatch: 7, KeepKeys: true})
			ctx := testenv.Ctx(t)
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			for i := range 50 {
				scope := "new"
				if i < 30 {
					scope = "old"
				}
				if err := s.ClaimTx(ctx, tx, dedup.Key{Scope: scope, ID: fmt.Sprint(i)}); err != nil {
					t.Fatal(err)
				}
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			// Expire the 30 old keys.
			if _, err := db.ExecContext(ctx, b.dialect.Rebind("UPDATE "+s.Table()+" SET expires_at = "+b.past+" WHERE scope = ?"), "old"); err != nil {
				t.Fatal(err)
			}
			n, err := s.Cleanup(ctx)
			if err != nil || n != 30 {
				t.Fatalf("Cleanup = %d, %v; want 30 deleted", n, err)
			}
			var left int
			if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+s.Table()+" WHERE scope = 'new'").Scan(&left); err != nil || left != 20 {
				t.Fatalf("%d new rows left (%v), want 20", left, err)
			}
			if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+s.Table()).Scan(&left); err != nil || left != 20 {
				t.Fatalf("%d rows left (%v), want 20", left, err)
			}
			// The loop stops with its context and leaves no goroutine
			// behind (goleak checks at the end of the package).
			lctx, cancel := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- s.CleanupLoop(lctx, 10*time.Millisecond) }()
			cancel()
			if err := <-done; !errors.Is(err, context.Canceled) {
				t.Fatalf("CleanupLoop returned %v, want context.Canceled", err)
			}
			if err := s.CleanupLoop(ctx, 0); err == nil {
				t.Fatal("CleanupLoop with a zero interval did not fail")
			}
		})
	}
}

// TestCleanupSkipsHeldRows: a cleanup on MariaDB or PostgreSQL neither waits
// for nor deletes an expired row that an open transaction is taking over;
// it deletes the other expired rows.
func TestCleanupSkipsHeldRows(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"mysql", "postgres-pgx"} {
		t.Run(name, func(t *testing.T) {
			b := backendByName(t, name)
			db := b.open(t)
			s := newStore(t, b, db, sqltable.Options{CleanupBatch: 3})
			ctx := testenv.Ctx(t)
			keys := make([]dedup.Key, 10)
			for i := range keys {
				keys[i] = dedup.NewKey("c", testenv.UniqueID("k"), nil)
				if _, err := s.Process(ctx, keys[i], func(context.Context, *sql.Tx) ([]byte, error) { return nil, nil }); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := db.ExecContext(ctx, "UPDATE "+s.Table()+" SET expires_at = "+b.past); err != nil {
				t.Fatal(err)
			}
			// An open transaction takes over the expired row of keys[0].
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback() }()
			if err := s.ClaimTx(ctx, tx, keys[0]); err != nil {
				t.Fatal(err)
			}
			n, err := s.Cleanup(ctx)
			if err != nil || n != 9 {
				t.Fatalf("Cleanup = %d, %v; want the 9 rows no transaction holds", n, err)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			if _, err := s.Process(ctx, keys[0], func(context.Context, *sql.Tx) ([]byte, error) { return nil, nil }); !errors.Is(err, dedup.ErrDuplicate) {
				t.Fatalf("the key taken over = %v, want ErrDuplicate", err)
			}
		})
	}
}

func TestMigrateConcurrentAndIdempotent(t *testing.T) {
	t.Parallel()
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			db := b.open(t)
			ctx := testenv.Ctx(t)
			opts := sqltable.Options{Table: testenv.Name("mig")}
			switch b.dialect {
			case sqltable.Postgres:
				opts.Schema = testenv.Name("idemmig") // does not exist yet: Migrate creates it
				t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), `DROP SCHEMA IF EXISTS "`+opts.Schema+`" CASCADE`) })
			case sqltable.MySQL:
				t.Cleanup(func() {
					_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS `"+opts.Table+"`, `"+opts.Table+"_migrations`")
				})
			}
			s, err := sqltable.New(db, b.dialect, opts)
			if err != nil {
				t.Fatal(err)
			}
			before, err := s.MigrationStatus(ctx)
			if err != nil || len(before) != 0 {
				t.Fatalf("status before Migrate = %v, %v; want none", before, err)
			}
			var wg sync.WaitGroup
			errs := make(chan error, 5)
			for range 5 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs <- s.Migrate(ctx)
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					t.Fatalf("concurrent Migrate: %v", err)
				}
			}
			if err := s.Migrate(ctx); err != nil {
				t.Fatalf("Migrate again: %v", err)
			}
			after, err := s.MigrationStatus(ctx)
			if err != nil || strings.Join(after, ",") != "0001_processed_events" {
				t.Fatalf("status = %v, %v", after, err)
			}
			script, err := s.SQL()
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(script, opts.Table) || strings.Contains(script, "{{") {
				t.Fatalf("SQL() is not rendered for the table:\n%s", script)
			}
			if _, err := s.Process(ctx, dedup.Key{Scope: "s", ID: "1"}, func(context.Context, *sql.Tx) ([]byte, error) { return nil, nil }); err != nil {
				t.Fatalf("store on the migrated table: %v", err)
			}
		})
	}
}
