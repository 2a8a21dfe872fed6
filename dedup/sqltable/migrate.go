package sqltable

import (
	"context"
	"embed"
	"fmt"
	"hash/fnv"
	"strconv"

	"github.com/idemkit/idem/internal/sqlmigrate"
)

//go:embed migrations/*/*.sql
var migrationFS embed.FS

// Migration is one embedded schema change, rendered for a store's dialect,
// schema and table.
type Migration struct {
	Version string // the file name without .sql, e.g. "0001_processed_events"
	SQL     string
}

type tmplData struct{ s *Store }

// Table is the quoted, qualified table.
func (d tmplData) Table() string { return d.s.table }

// BareTable is the quoted table without its schema.
func (d tmplData) BareTable() string { return d.s.dialect.Quote(d.s.opts.Table) }

// Index is the quoted name of one of the table's indexes.
func (d tmplData) Index(suffix string) string {
	return d.s.dialect.Quote(d.s.opts.Table + "_" + suffix + "_idx")
}

// SchemaIndex is Index qualified by the schema (SQLite names an index's
// database on the index, not on its table).
func (d tmplData) SchemaIndex(suffix string) string {
	return qualified(d.s.dialect, d.s.opts.Schema, d.s.opts.Table+"_"+suffix+"_idx")
}

// Migrations returns the store's migrations in order.
func (s *Store) Migrations() ([]Migration, error) {
	ms, err := sqlmigrate.Render[Migration](migrationFS, "migrations/"+s.dialect.String(), tmplData{s})
	if err != nil {
		return nil, fmt.Errorf("sqltable: %w", err)
	}
	return ms, nil
}

// SQL returns every migration as one script (on PostgreSQL with the schema's
// creation), for users who apply schema changes with goose, golang-migrate
// or by hand.
func (s *Store) SQL() (string, error) {
	ms, err := s.Migrations()
	if err != nil {
		return "", err
	}
	schema := ""
	if s.dialect == Postgres && s.opts.Schema != "" {
		schema = s.dialect.Quote(s.opts.Schema)
	}
	return sqlmigrate.Script("sqltable", schema, ms), nil
}

func (s *Store) versionTable() string {
	return qualified(s.dialect, s.opts.Schema, s.opts.Table+"_migrations")
}

// lockName names the lock Migrate holds, per table.
func (s *Store) lockName() string {
	h := fnv.New64a()
	h.Write([]byte(s.opts.Schema + "." + s.opts.Table))
	return "idem:sqltable:migrate:" + strconv.FormatUint(h.Sum64(), 16)
}

// Migrate applies the migrations that are not applied yet and records them
// in <table>_migrations. Several processes may call it at once: one
// applies, the others wait and find nothing to do. On PostgreSQL it runs
// in one transaction under a transaction-scoped advisory lock and creates
// Options.Schema; on MySQL and MariaDB under GET_LOCK on one connection
// (DDL commits on its own there: a migration interrupted half-way is
// applied again, every statement being IF NOT EXISTS); on SQLite in one
// BEGIN IMMEDIATE transaction.
func (s *Store) Migrate(ctx context.Context) error {
	ms, err := s.Migrations()
	if err != nil {
		return err
	}
	t := sqlmigrate.Target{Dialect: s.dialect, Schema: s.opts.Schema, VersionTable: s.versionTable(), LockName: s.lockName()}
	if err := sqlmigrate.Apply(ctx, s.db, t, ms); err != nil {
		return fmt.Errorf("sqltable: migrate %s: %w", s.table, err)
	}
	return nil
}

// MigrationStatus returns the applied versions, oldest first; empty when
// Migrate never ran.
func (s *Store) MigrationStatus(ctx context.Context) ([]string, error) {
	out, err := sqlmigrate.Applied(ctx, s.db, s.dialect, s.opts.Schema, s.opts.Table+"_migrations", s.versionTable())
	if err != nil {
		return nil, fmt.Errorf("sqltable: migration status of %s: %w", s.table, err)
	}
	return out, nil
}
