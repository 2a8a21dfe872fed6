package kafkasql

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

// Migration is one embedded schema change, rendered for the dialect, schema
// and table of an Offsets.
type Migration struct {
	Version string // the file name without .sql, e.g. "0001_kafka_offsets"
	SQL     string
}

type tmplData struct{ o *Offsets }

// Table is the quoted, qualified table.
func (d tmplData) Table() string { return d.o.table }

// Migrations returns the migrations of o's dialect in order.
func (o *Offsets) Migrations() ([]Migration, error) {
	ms, err := sqlmigrate.Render[Migration](migrationFS, "migrations/"+o.dialect.String(), tmplData{o})
	if err != nil {
		return nil, fmt.Errorf("kafkasql: %w", err)
	}
	return ms, nil
}

// SQL returns every migration as one script (on PostgreSQL with the
// schema's creation), for goose, golang-migrate or by hand.
func (o *Offsets) SQL() (string, error) {
	ms, err := o.Migrations()
	if err != nil {
		return "", err
	}
	schema := ""
	if o.dialect == Postgres && o.opts.Schema != "" {
		schema = o.dialect.Quote(o.opts.Schema)
	}
	return sqlmigrate.Script("kafkasql", schema, ms), nil
}

func (o *Offsets) versionTable() string {
	return qualified(o.dialect, o.opts.Schema, o.opts.Table+"_migrations")
}

// lockName names the lock Migrate holds, per table.
func (o *Offsets) lockName() string {
	h := fnv.New64a()
	h.Write([]byte(o.opts.Schema + "." + o.opts.Table))
	return "idem:kafkasql:migrate:" + strconv.FormatUint(h.Sum64(), 16)
}

// Migrate applies the migrations that are not applied yet and records them
// in <table>_migrations. Several processes may call it at once: one
// applies, the others wait and find nothing to do. On PostgreSQL it runs in
// one transaction under a transaction-scoped advisory lock and creates
// Options.Schema; on MySQL and MariaDB under GET_LOCK on one connection
// (DDL commits on its own there; every statement is IF NOT EXISTS, so an
// interrupted migration is applied again); on SQLite in one BEGIN IMMEDIATE
// transaction.
func (o *Offsets) Migrate(ctx context.Context) error {
	ms, err := o.Migrations()
	if err != nil {
		return err
	}
	t := sqlmigrate.Target{Dialect: o.dialect, Schema: o.opts.Schema, VersionTable: o.versionTable(), LockName: o.lockName()}
	if o.dialect == MySQL {
		t.VersionColumns = " (version VARCHAR(255) NOT NULL PRIMARY KEY, applied_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB"
	}
	if err := sqlmigrate.Apply(ctx, o.db, t, ms); err != nil {
		return fmt.Errorf("kafkasql: migrate %s: %w", o.table, err)
	}
	return nil
}
