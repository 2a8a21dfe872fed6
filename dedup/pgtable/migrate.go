package pgtable

import (
	"bytes"
	"context"
	"embed"
	"fmt"
	"hash/fnv"
	"io/fs"
	"sort"
	"text/template"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/sqlname"
)

//go:embed migrations/*.sql migrations_partitioned/*.sql
var migrationFS embed.FS

// Migration is one embedded schema change, rendered for a store's schema and
// table.
type Migration struct {
	Version string // file name, e.g. "0001_processed_events"
	SQL     string
}

type tmplData struct {
	schema, table string
}

func (d tmplData) Table() string { return sqlname.Qualified(d.schema, d.table) }

func (d tmplData) Index(suffix string) string { return sqlname.Quote(d.table + "_" + suffix + "_idx") }

func (d tmplData) Partition(suffix string) string {
	return sqlname.Qualified(d.schema, d.table+"_p"+suffix)
}

// Migrations returns the store's migrations in order.
func (s *Store) Migrations() ([]Migration, error) {
	dir := "migrations"
	if s.opts.Partitioned {
		dir = "migrations_partitioned"
	}
	names, err := fs.Glob(migrationFS, dir+"/*.sql")
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	data := tmplData{schema: s.opts.Schema, table: s.opts.Table}
	out := make([]Migration, 0, len(names))
	for _, n := range names {
		raw, err := migrationFS.ReadFile(n)
		if err != nil {
			return nil, err
		}
		t, err := template.New(n).Parse(string(raw))
		if err != nil {
			return nil, fmt.Errorf("pgtable: migration %s: %w", n, err)
		}
		var b bytes.Buffer
		if err := t.Execute(&b, data); err != nil {
			return nil, fmt.Errorf("pgtable: migration %s: %w", n, err)
		}
		v := n[len(dir)+1 : len(n)-len(".sql")]
		out = append(out, Migration{Version: v, SQL: b.String()})
	}
	return out, nil
}

// SQL returns every migration as one script, with the schema creation, for
// users who apply schema changes with goose, golang-migrate or by hand.
func (s *Store) SQL() (string, error) {
	ms, err := s.Migrations()
	if err != nil {
		return "", err
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "CREATE SCHEMA IF NOT EXISTS %s;\n", sqlname.Quote(s.opts.Schema))
	for _, m := range ms {
		fmt.Fprintf(&b, "\n-- idem pgtable migration %s\n%s", m.Version, m.SQL)
	}
	return b.String(), nil
}

func (s *Store) versionTable() string {
	return sqlname.Qualified(s.opts.Schema, s.opts.Table+"_migrations")
}

func (s *Store) lockKey() int64 {
	h := fnv.New64a()
	h.Write([]byte("idem:pgtable:migrate:" + s.opts.Schema + "." + s.opts.Table))
	return int64(h.Sum64())
}

// Migrate applies the migrations that are not applied yet, in one
// transaction under a transaction-scoped advisory lock, so several processes
// may call it at once: one applies, the others wait and find nothing to do.
// Applied versions are recorded in <table>_migrations.
func (s *Store) Migrate(ctx context.Context) error {
	ms, err := s.Migrations()
	if err != nil {
		return err
	}
	return pgx.BeginFunc(ctx, s.db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", s.lockKey()); err != nil {
			return fmt.Errorf("pgtable: migrate: lock: %w", err)
		}
		if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+sqlname.Quote(s.opts.Schema)); err != nil {
			return fmt.Errorf("pgtable: migrate: schema: %w", err)
		}
		if _, err := tx.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+s.versionTable()+
			" (version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"); err != nil {
			return fmt.Errorf("pgtable: migrate: version table: %w", err)
		}
		for _, m := range ms {
			tag, err := tx.Exec(ctx, "INSERT INTO "+s.versionTable()+" (version) VALUES ($1) ON CONFLICT DO NOTHING", m.Version)
			if err != nil {
				return fmt.Errorf("pgtable: migrate %s: %w", m.Version, err)
			}
			if tag.RowsAffected() == 0 {
				continue // applied before
			}
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("pgtable: migrate %s: %w", m.Version, err)
			}
		}
		if s.opts.Partitioned {
			return s.ensurePartitions(ctx, tx)
		}
		return nil
	})
}

// MigrationStatus returns the applied versions, oldest first; empty when
// Migrate never ran.
func (s *Store) MigrationStatus(ctx context.Context) ([]string, error) {
	var exists bool
	err := s.db.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", s.versionTable()).Scan(&exists)
	if err != nil {
		return nil, fmt.Errorf("pgtable: migration status: %w", err)
	}
	if !exists {
		return nil, nil
	}
	rows, err := s.db.Query(ctx, "SELECT version FROM "+s.versionTable()+" ORDER BY version")
	if err != nil {
		return nil, fmt.Errorf("pgtable: migration status: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}
