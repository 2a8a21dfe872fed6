// Package pgmigrate applies the embedded SQL migrations of idem's PostgreSQL
// packages (dedup/pgtable, outbox/pgoutbox, adapters/kafka/kafkapg) the same
// way everywhere: files rendered as text/template for the user's schema and
// table names (validated and quoted by the caller), applied in one
// transaction under a transaction-scoped advisory lock so several processes
// may migrate at once, and recorded in a version table.
package pgmigrate

import (
	"bytes"
	"context"
	"fmt"
	"hash/fnv"
	"io/fs"
	"sort"
	"text/template"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/sqlname"
)

// Migration is one schema change, rendered.
type Migration struct {
	Version string // the file name without .sql, e.g. "0001_processed_events"
	SQL     string
}

// Render returns the migrations dir/*.sql of fsys in file-name order, each
// executed as a text/template with data. who prefixes errors.
func Render(who string, fsys fs.FS, dir string, data any) ([]Migration, error) {
	names, err := fs.Glob(fsys, dir+"/*.sql")
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	out := make([]Migration, 0, len(names))
	for _, n := range names {
		raw, err := fs.ReadFile(fsys, n)
		if err != nil {
			return nil, err
		}
		t, err := template.New(n).Parse(string(raw))
		if err != nil {
			return nil, fmt.Errorf("%s: migration %s: %w", who, n, err)
		}
		var b bytes.Buffer
		if err := t.Execute(&b, data); err != nil {
			return nil, fmt.Errorf("%s: migration %s: %w", who, n, err)
		}
		out = append(out, Migration{Version: n[len(dir)+1 : len(n)-len(".sql")], SQL: b.String()})
	}
	return out, nil
}

// Script returns the schema creation and every migration as one script, for
// users who apply schema changes with goose, golang-migrate or by hand.
func Script(who, schema string, ms []Migration) string {
	var b bytes.Buffer
	fmt.Fprintf(&b, "CREATE SCHEMA IF NOT EXISTS %s;\n", sqlname.Quote(schema))
	for _, m := range ms {
		fmt.Fprintf(&b, "\n-- idem %s migration %s\n%s", who, m.Version, m.SQL)
	}
	return b.String()
}

// LockKey returns the advisory lock key for name.
func LockKey(name string) int64 {
	h := fnv.New64a()
	h.Write([]byte(name))
	return int64(h.Sum64())
}

// Target says where migrations go.
type Target struct {
	Who          string // error prefix, e.g. "pgtable"
	Schema       string // created if missing
	VersionTable string // quoted, schema-qualified
	LockKey      int64
}

// Beginner starts transactions: a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Migrate applies the migrations not yet recorded in t.VersionTable, in one
// transaction on db under pg_advisory_xact_lock(t.LockKey): concurrent
// callers wait for the first and then find nothing to do. after, if not nil,
// runs last in the same transaction.
func Migrate(ctx context.Context, db Beginner, t Target, ms []Migration, after func(context.Context, pgx.Tx) error) error {
	return pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", t.LockKey); err != nil {
			return fmt.Errorf("%s: migrate: lock: %w", t.Who, err)
		}
		if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+sqlname.Quote(t.Schema)); err != nil {
			return fmt.Errorf("%s: migrate: schema: %w", t.Who, err)
		}
		if _, err := tx.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+t.VersionTable+
			" (version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"); err != nil {
			return fmt.Errorf("%s: migrate: version table: %w", t.Who, err)
		}
		for _, m := range ms {
			tag, err := tx.Exec(ctx, "INSERT INTO "+t.VersionTable+" (version) VALUES ($1) ON CONFLICT DO NOTHING", m.Version)
			if err != nil {
				return fmt.Errorf("%s: migrate %s: %w", t.Who, m.Version, err)
			}
			if tag.RowsAffected() == 0 {
				continue // applied before
			}
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("%s: migrate %s: %w", t.Who, m.Version, err)
			}
		}
		if after != nil {
			return after(ctx, tx)
		}
		return nil
	})
}

// Querier runs queries: a pool, a conn or a tx.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Status returns the versions recorded in versionTable (quoted), oldest
// first; empty when nothing was ever applied.
func Status(ctx context.Context, who string, db Querier, versionTable string) ([]string, error) {
	var exists bool
	if err := db.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", versionTable).Scan(&exists); err != nil {
		return nil, fmt.Errorf("%s: migration status: %w", who, err)
	}
	if !exists {
		return nil, nil
	}
	rows, err := db.Query(ctx, "SELECT version FROM "+versionTable+" ORDER BY version")
	if err != nil {
		return nil, fmt.Errorf("%s: migration status: %w", who, err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("%s: migration status: %w", who, err)
	}
	return versions, nil
}
