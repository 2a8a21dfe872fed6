package pgoutbox

import (
	"context"
	"embed"
	"fmt"

	"github.com/idemkit/idem/internal/pgmigrate"
	"github.com/idemkit/idem/internal/sqlname"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

// Migration is one embedded schema change, rendered for an outbox's schema
// and table.
type Migration = pgmigrate.Migration

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
	return pgmigrate.Render("pgoutbox", migrationFS, "migrations", tmplData{schema: o.opts.Schema, table: o.opts.Table})
}

// SQL returns every migration as one script, with the schema creation, for
// users who apply schema changes with goose, golang-migrate or by hand.
func (o *Outbox) SQL() (string, error) {
	ms, err := o.Migrations()
	if err != nil {
		return "", err
	}
	return pgmigrate.Script("pgoutbox", o.opts.Schema, ms), nil
}

func (o *Outbox) versionTable() string {
	return sqlname.Qualified(o.opts.Schema, o.opts.Table+"_migrations")
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
	return pgmigrate.Migrate(ctx, o.pool, pgmigrate.Target{
		Who:          "pgoutbox",
		Schema:       o.opts.Schema,
		VersionTable: o.versionTable(),
		LockKey:      pgmigrate.LockKey("idem:pgoutbox:migrate:" + o.opts.Schema + "." + o.opts.Table),
	}, ms, nil)
}

// MigrationStatus returns the applied versions, oldest first; empty when
// Migrate never ran.
func (o *Outbox) MigrationStatus(ctx context.Context) ([]string, error) {
	if o.pool == nil {
		return nil, errNoPool("MigrationStatus")
	}
	return pgmigrate.Status(ctx, "pgoutbox", o.pool, o.versionTable())
}

func errNoPool(what string) error {
	return fmt.Errorf("pgoutbox: %s needs a pool: pass one to New", what)
}
