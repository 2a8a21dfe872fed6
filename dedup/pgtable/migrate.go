package pgtable

import (
	"context"
	"embed"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/pgmigrate"
	"github.com/idemkit/idem/internal/sqlname"
)

//go:embed migrations/*.sql migrations_partitioned/*.sql
var migrationFS embed.FS

// Migration is one embedded schema change, rendered for a store's schema and
// table.
type Migration = pgmigrate.Migration

type tmplData struct {
	schema, table string
	part          partitioning
	keepKeys      bool
	orderedKeys   bool
}

// KeepKeys is Options.KeepKeys.
func (d tmplData) KeepKeys() bool { return d.keepKeys }

// Key is the SQL expression of the row key of the text expressions scope
// and id (keySQL).
func (d tmplData) Key(scope, id string) string { return keySQL(scope, id, d.orderedKeys) }

// PartColumn and PartType are the partition key of a partitioned table.
func (d tmplData) PartColumn() string { return d.part.column }

func (d tmplData) PartType() string { return d.part.typ }

// Schema and TableName are the unquoted names, for string literals of SQL
// that builds names (both passed the allow-list).
func (d tmplData) Schema() string { return d.schema }

func (d tmplData) TableName() string { return d.table }

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
	return pgmigrate.Render("pgtable", migrationFS, dir, tmplData{schema: s.opts.Schema, table: s.opts.Table, part: s.part, keepKeys: s.opts.KeepKeys, orderedKeys: s.opts.TimeOrderedKeys})
}

// SQL returns every migration as one script, with the schema creation, for
// users who apply schema changes with goose, golang-migrate or by hand.
func (s *Store) SQL() (string, error) {
	ms, err := s.Migrations()
	if err != nil {
		return "", err
	}
	return pgmigrate.Script("pgtable", s.opts.Schema, ms), nil
}

func (s *Store) versionTable() string {
	return sqlname.Qualified(s.opts.Schema, s.opts.Table+"_migrations")
}

func (s *Store) lockKey() int64 {
	return pgmigrate.LockKey("idem:pgtable:migrate:" + s.opts.Schema + "." + s.opts.Table)
}

// Migrate applies the migrations that are not applied yet, in one
// transaction under a transaction-scoped advisory lock, so several processes
// may call it at once: one applies, the others wait and find nothing to do.
// Applied versions are recorded in <table>_migrations. With
// Options.Partitioned it also creates the partitions ahead (see
// EnsurePartitions).
func (s *Store) Migrate(ctx context.Context) error {
	ms, err := s.Migrations()
	if err != nil {
		return err
	}
	var after func(context.Context, pgx.Tx) error
	if s.opts.Partitioned {
		after = s.ensurePartitions
	}
	return pgmigrate.Migrate(ctx, s.db, pgmigrate.Target{
		Who: "pgtable", Schema: s.opts.Schema, VersionTable: s.versionTable(), LockKey: s.lockKey(),
	}, ms, after)
}

// MigrationStatus returns the applied versions, oldest first; empty when
// Migrate never ran.
func (s *Store) MigrationStatus(ctx context.Context) ([]string, error) {
	return pgmigrate.Status(ctx, "pgtable", s.db, s.versionTable())
}
