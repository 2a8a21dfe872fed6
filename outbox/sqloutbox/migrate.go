package sqloutbox

import (
	"context"
	"database/sql"
	"embed"
	"fmt"

	"github.com/idemkit/idem/internal/sqlmigrate"
	"github.com/idemkit/idem/internal/sqlname"
)

//go:embed migrations
var migrationFS embed.FS

// Migration is one embedded schema change, rendered for an outbox's
// dialect and table.
type Migration struct {
	// Version is the file name without .sql, e.g. "0001_outbox".
	Version string
	// SQL is the statements, each ending with ";" at the end of a line.
	SQL string
}

type tmplData struct {
	o *Outbox
}

func (d tmplData) Table() string { return d.o.table }

func (d tmplData) KeyTable() string { return d.o.sql.keyTable }

func (d tmplData) Index(suffix string) string {
	return d.o.dialect.Quote(d.o.opts.Table + "_" + suffix + "_idx")
}

func (d tmplData) Constraint(suffix string) string {
	return d.o.dialect.Quote(d.o.opts.Table + "_" + suffix + "_key")
}

// Migrations returns the outbox's migrations for its dialect, in order. On
// PostgreSQL they are outbox/pgoutbox's, recorded under the same versions
// in the same table, so pgoutbox's Migrate and this one are
// interchangeable.
func (o *Outbox) Migrations() ([]Migration, error) {
	ms, err := sqlmigrate.Render[Migration](migrationFS, "migrations/"+o.dialect.String(), tmplData{o: o})
	if err != nil {
		return nil, fmt.Errorf("sqloutbox: %w", err)
	}
	return ms, nil
}

// SQL returns every migration as one script (with the schema creation on
// PostgreSQL), for users who apply schema changes with goose,
// golang-migrate or by hand.
func (o *Outbox) SQL() (string, error) {
	ms, err := o.Migrations()
	if err != nil {
		return "", err
	}
	schema := ""
	if o.dialect == Postgres {
		schema = sqlname.Quote(o.opts.Schema)
	}
	return sqlmigrate.Script("sqloutbox", schema, ms), nil
}

func (o *Outbox) versionTable() string {
	if o.dialect == Postgres {
		return sqlname.Qualified(o.opts.Schema, o.opts.Table+"_migrations")
	}
	return o.dialect.Quote(o.opts.Table + "_migrations")
}

// Migrate applies the migrations that are not applied yet and records them
// in <Table>_migrations. Several processes may call it at once: one
// applies, the others wait and find nothing to do.
//
// On PostgreSQL it runs in one transaction under pgoutbox's
// transaction-scoped advisory lock; on SQLite in one BEGIN IMMEDIATE
// transaction. On MySQL DDL commits by itself, so Migrate runs on one
// connection under a named lock (GET_LOCK) and records each version after
// its statements succeeded; the statements are idempotent, so a Migrate
// that was interrupted can be run again.
func (o *Outbox) Migrate(ctx context.Context) error {
	if o.db == nil {
		return errNoDB("Migrate")
	}
	ms, err := o.Migrations()
	if err != nil {
		return err
	}
	vt := o.versionTable()
	t := sqlmigrate.Target{Dialect: o.dialect, VersionTable: vt}
	switch o.dialect {
	case Postgres:
		// pgoutbox's schema, version table and lock key, so that both
		// packages' Migrate serialize and record the same versions.
		t.Schema = o.opts.Schema
		t.LockName = "idem:pgoutbox:migrate:" + o.opts.Schema + "." + o.opts.Table
	case MySQL:
		t.VersionColumns = " (version VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY, applied_at DATETIME(6) NOT NULL) ENGINE = InnoDB"
		t.Record = "INSERT IGNORE INTO " + vt + " (version, applied_at) VALUES (?, UTC_TIMESTAMP(6))"
		t.MySQLLock = "CONCAT('idem_outbox_', MD5(CONCAT(DATABASE(), '.', ?)))"
		t.MySQLLockArgs = []any{o.opts.Table}
	default:
		t.VersionColumns = " (version TEXT NOT NULL PRIMARY KEY, applied_at INTEGER NOT NULL)"
		t.Record = "INSERT OR IGNORE INTO " + vt + " (version, applied_at) VALUES (?, CAST(unixepoch('subsec') * 1000000 AS INTEGER))"
	}
	if err := sqlmigrate.Apply(ctx, o.db, t, ms); err != nil {
		return fmt.Errorf("sqloutbox: migrate %s: %w", o.table, err)
	}
	return nil
}

type queryer interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// MigrationStatus returns the applied versions, oldest first; empty when
// Migrate never ran.
func (o *Outbox) MigrationStatus(ctx context.Context) ([]string, error) {
	if o.db == nil {
		return nil, errNoDB("MigrationStatus")
	}
	schema := ""
	if o.dialect == Postgres {
		schema = o.opts.Schema
	}
	out, err := sqlmigrate.Applied(ctx, o.db, o.dialect, schema, o.opts.Table+"_migrations", o.versionTable())
	if err != nil {
		return nil, fmt.Errorf("sqloutbox: migration status: %w", err)
	}
	if out == nil {
		out = []string{}
	}
	return out, nil
}

func errNoDB(what string) error {
	return fmt.Errorf("sqloutbox: %s needs a *sql.DB: pass one to New", what)
}
