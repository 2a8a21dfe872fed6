package pgoutbox

import (
	"bytes"
	"context"
	"embed"
	"fmt"
	"io/fs"
	"sort"
	"text/template"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/sqlname"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

// Migration is one embedded schema change, rendered for an outbox's schema
// and table.
type Migration struct {
	Version string // file name, e.g. "0001_outbox"
	SQL     string
}

type tmplData struct {
	schema, table string
}

func (d tmplData) Table() string { return sqlname.Qualified(d.schema, d.table) }

func (d tmplData) Index(suffix string) string { return sqlname.Quote(d.table + "_" + suffix + "_idx") }

func (d tmplData) Constraint(suffix string) string {
	return sqlname.Quote(d.table + "_" + suffix + "_key")
}

// Migrations returns the outbox's migrations in order.
func (o *Outbox) Migrations() ([]Migration, error) {
	names, err := fs.Glob(migrationFS, "migrations/*.sql")
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	data := tmplData{schema: o.opts.Schema, table: o.opts.Table}
	out := make([]Migration, 0, len(names))
	for _, n := range names {
		raw, err := migrationFS.ReadFile(n)
		if err != nil {
			return nil, err
		}
		t, err := template.New(n).Parse(string(raw))
		if err != nil {
			return nil, fmt.Errorf("pgoutbox: migration %s: %w", n, err)
		}
		var b bytes.Buffer
		if err := t.Execute(&b, data); err != nil {
			return nil, fmt.Errorf("pgoutbox: migration %s: %w", n, err)
		}
		v := n[len("migrations/") : len(n)-len(".sql")]
		out = append(out, Migration{Version: v, SQL: b.String()})
	}
	return out, nil
}

// SQL returns every migration as one script, with the schema creation, for
// users who apply schema changes with goose, golang-migrate or by hand.
func (o *Outbox) SQL() (string, error) {
	ms, err := o.Migrations()
	if err != nil {
		return "", err
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "CREATE SCHEMA IF NOT EXISTS %s;\n", sqlname.Quote(o.opts.Schema))
	for _, m := range ms {
		fmt.Fprintf(&b, "\n-- idem pgoutbox migration %s\n%s", m.Version, m.SQL)
	}
	return b.String(), nil
}

func (o *Outbox) versionTable() string {
	return sqlname.Qualified(o.opts.Schema, o.opts.Table+"_migrations")
}

func (o *Outbox) migrateLockKey() int64 {
	return int64(fnvSum64("idem:pgoutbox:migrate:" + o.opts.Schema + "." + o.opts.Table))
}

// Migrate applies the migrations that are not applied yet, in one
// transaction under a transaction-scoped advisory lock, so several processes
// may call it at once: one applies, the others wait and find nothing to do.
// Applied versions are recorded in <table>_migrations.
func (o *Outbox) Migrate(ctx context.Context) error {
	if o.pool == nil {
		return errNoPool("Migrate")
	}
	ms, err := o.Migrations()
	if err != nil {
		return err
	}
	return pgx.BeginFunc(ctx, o.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", o.migrateLockKey()); err != nil {
			return fmt.Errorf("pgoutbox: migrate: lock: %w", err)
		}
		if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+sqlname.Quote(o.opts.Schema)); err != nil {
			return fmt.Errorf("pgoutbox: migrate: schema: %w", err)
		}
		if _, err := tx.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+o.versionTable()+
			" (version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"); err != nil {
			return fmt.Errorf("pgoutbox: migrate: version table: %w", err)
		}
		for _, m := range ms {
			tag, err := tx.Exec(ctx, "INSERT INTO "+o.versionTable()+" (version) VALUES ($1) ON CONFLICT DO NOTHING", m.Version)
			if err != nil {
				return fmt.Errorf("pgoutbox: migrate %s: %w", m.Version, err)
			}
			if tag.RowsAffected() == 0 {
				continue // applied before
			}
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("pgoutbox: migrate %s: %w", m.Version, err)
			}
		}
		return nil
	})
}

// MigrationStatus returns the applied versions, oldest first; empty when
// Migrate never ran.
func (o *Outbox) MigrationStatus(ctx context.Context) ([]string, error) {
	if o.pool == nil {
		return nil, errNoPool("MigrationStatus")
	}
	var exists bool
	err := o.pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", o.versionTable()).Scan(&exists)
	if err != nil {
		return nil, fmt.Errorf("pgoutbox: migration status: %w", err)
	}
	if !exists {
		return nil, nil
	}
	rows, err := o.pool.Query(ctx, "SELECT version FROM "+o.versionTable()+" ORDER BY version")
	if err != nil {
		return nil, fmt.Errorf("pgoutbox: migration status: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

func errNoPool(what string) error {
	return fmt.Errorf("pgoutbox: %s needs a pool: the package-level Enqueue's outbox has none; use New", what)
}
