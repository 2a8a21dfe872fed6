package sqloutbox

import (
	"bytes"
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"strings"
	"text/template"

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
	dir := "migrations/" + o.dialect.String()
	names, err := fs.Glob(migrationFS, dir+"/*.sql")
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	out := make([]Migration, 0, len(names))
	for _, n := range names {
		raw, err := fs.ReadFile(migrationFS, n)
		if err != nil {
			return nil, err
		}
		t, err := template.New(n).Parse(string(raw))
		if err != nil {
			return nil, fmt.Errorf("sqloutbox: migration %s: %w", n, err)
		}
		var b bytes.Buffer
		if err := t.Execute(&b, tmplData{o: o}); err != nil {
			return nil, fmt.Errorf("sqloutbox: migration %s: %w", n, err)
		}
		out = append(out, Migration{Version: strings.TrimSuffix(n[len(dir)+1:], ".sql"), SQL: b.String()})
	}
	return out, nil
}

// SQL returns every migration as one script (with the schema creation on
// PostgreSQL), for users who apply schema changes with goose,
// golang-migrate or by hand.
func (o *Outbox) SQL() (string, error) {
	ms, err := o.Migrations()
	if err != nil {
		return "", err
	}
	var b strings.Builder
	if o.dialect == Postgres {
		fmt.Fprintf(&b, "CREATE SCHEMA IF NOT EXISTS %s;\n", sqlname.Quote(o.opts.Schema))
	}
	for _, m := range ms {
		fmt.Fprintf(&b, "\n-- idem sqloutbox migration %s\n%s", m.Version, m.SQL)
	}
	return b.String(), nil
}

// statementsOf splits a migration into its statements: full-line comments
// dropped, a statement ends with ";" at the end of a line.
func statementsOf(script string) []string {
	var (
		out []string
		cur strings.Builder
	)
	for line := range strings.SplitSeq(script, "\n") {
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "--") || (trimmed == "" && cur.Len() == 0) {
			continue
		}
		cur.WriteString(line)
		cur.WriteByte('\n')
		if strings.HasSuffix(trimmed, ";") {
			out = append(out, strings.TrimSuffix(strings.TrimSpace(cur.String()), ";"))
			cur.Reset()
		}
	}
	if s := strings.TrimSpace(cur.String()); s != "" {
		out = append(out, s)
	}
	return out
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
	var merr error
	switch o.dialect {
	case Postgres:
		merr = o.migratePostgres(ctx, ms)
	case MySQL:
		merr = o.migrateMySQL(ctx, ms)
	default:
		merr = o.migrateSQLite(ctx, ms)
	}
	if merr != nil {
		return fmt.Errorf("sqloutbox: migrate %s: %w", o.table, merr)
	}
	return nil
}

func (o *Outbox) migratePostgres(ctx context.Context, ms []Migration) (err error) {
	tx, err := o.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback()
		}
	}()
	// pgoutbox's lock key, so that both packages' Migrate serialize.
	lock := int64(fnvSum64("idem:pgoutbox:migrate:" + o.opts.Schema + "." + o.opts.Table))
	if _, err := tx.ExecContext(ctx, "SELECT pg_advisory_xact_lock($1)", lock); err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	if _, err := tx.ExecContext(ctx, "CREATE SCHEMA IF NOT EXISTS "+sqlname.Quote(o.opts.Schema)); err != nil {
		return fmt.Errorf("schema: %w", err)
	}
	vt := o.versionTable()
	if _, err := tx.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+vt+
		" (version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"); err != nil {
		return fmt.Errorf("version table: %w", err)
	}
	for _, m := range ms {
		res, err := tx.ExecContext(ctx, "INSERT INTO "+vt+" (version) VALUES ($1) ON CONFLICT DO NOTHING", m.Version)
		if err != nil {
			return fmt.Errorf("%s: %w", m.Version, err)
		}
		if n, err := res.RowsAffected(); err != nil || n == 0 {
			continue // applied before
		}
		for _, s := range statementsOf(m.SQL) {
			if _, err := tx.ExecContext(ctx, s); err != nil {
				return fmt.Errorf("%s: %w", m.Version, err)
			}
		}
	}
	return tx.Commit()
}

func (o *Outbox) migrateMySQL(ctx context.Context, ms []Migration) error {
	conn, err := o.db.Conn(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	const lockName = "CONCAT('idem_outbox_', MD5(CONCAT(DATABASE(), '.', ?)))"
	var got sql.NullInt64
	if err := conn.QueryRowContext(ctx, "SELECT GET_LOCK("+lockName+", 60)", o.opts.Table).Scan(&got); err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	if got.Int64 != 1 {
		return errors.New("lock: another Migrate held the lock for 60s")
	}
	defer func() {
		// The lock ends with the connection too; release it so the
		// connection goes back to the pool clean.
		_, _ = conn.ExecContext(context.WithoutCancel(ctx), "DO RELEASE_LOCK("+lockName+")", o.opts.Table)
	}()
	vt := o.versionTable()
	if _, err := conn.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+vt+
		" (version VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY, applied_at DATETIME(6) NOT NULL) ENGINE = InnoDB"); err != nil {
		return fmt.Errorf("version table: %w", err)
	}
	applied, err := o.status(ctx, conn)
	if err != nil {
		return err
	}
	for _, m := range ms {
		if applied[m.Version] {
			continue
		}
		for _, s := range statementsOf(m.SQL) {
			if _, err := conn.ExecContext(ctx, s); err != nil {
				return fmt.Errorf("%s: %w", m.Version, err)
			}
		}
		if _, err := conn.ExecContext(ctx, "INSERT IGNORE INTO "+vt+" (version, applied_at) VALUES (?, UTC_TIMESTAMP(6))", m.Version); err != nil {
			return fmt.Errorf("%s: %w", m.Version, err)
		}
	}
	return nil
}

func (o *Outbox) migrateSQLite(ctx context.Context, ms []Migration) (err error) {
	conn, err := o.db.Conn(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	if _, err := conn.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil {
			_, _ = conn.ExecContext(context.WithoutCancel(ctx), "ROLLBACK")
		}
	}()
	vt := o.versionTable()
	if _, err := conn.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+vt+
		" (version TEXT NOT NULL PRIMARY KEY, applied_at INTEGER NOT NULL)"); err != nil {
		return fmt.Errorf("version table: %w", err)
	}
	for _, m := range ms {
		res, err := conn.ExecContext(ctx, "INSERT OR IGNORE INTO "+vt+
			" (version, applied_at) VALUES (?, CAST(unixepoch('subsec') * 1000000 AS INTEGER))", m.Version)
		if err != nil {
			return fmt.Errorf("%s: %w", m.Version, err)
		}
		if n, err := res.RowsAffected(); err != nil || n == 0 {
			continue
		}
		for _, s := range statementsOf(m.SQL) {
			if _, err := conn.ExecContext(ctx, s); err != nil {
				return fmt.Errorf("%s: %w", m.Version, err)
			}
		}
	}
	if _, err := conn.ExecContext(ctx, "COMMIT"); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

type queryer interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// status returns the applied versions; none when the version table does
// not exist.
func (o *Outbox) status(ctx context.Context, q queryer) (map[string]bool, error) {
	var exists int
	var err error
	switch o.dialect {
	case Postgres:
		err = q.QueryRowContext(ctx, "SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = $2",
			o.opts.Schema, o.opts.Table+"_migrations").Scan(&exists)
	case MySQL:
		err = q.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?",
			o.opts.Table+"_migrations").Scan(&exists)
	default:
		err = q.QueryRowContext(ctx, "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = ?",
			o.opts.Table+"_migrations").Scan(&exists)
	}
	if err != nil {
		return nil, fmt.Errorf("migration status: %w", err)
	}
	applied := map[string]bool{}
	if exists == 0 {
		return applied, nil
	}
	rows, err := q.QueryContext(ctx, "SELECT version FROM "+o.versionTable())
	if err != nil {
		return nil, fmt.Errorf("migration status: %w", err)
	}
	defer func() { _ = rows.Close() }()
	for rows.Next() {
		var v string
		if err := rows.Scan(&v); err != nil {
			return nil, fmt.Errorf("migration status: %w", err)
		}
		applied[v] = true
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("migration status: %w", err)
	}
	return applied, nil
}

// MigrationStatus returns the applied versions, oldest first; empty when
// Migrate never ran.
func (o *Outbox) MigrationStatus(ctx context.Context) ([]string, error) {
	if o.db == nil {
		return nil, errNoDB("MigrationStatus")
	}
	applied, err := o.status(ctx, o.db)
	if err != nil {
		return nil, fmt.Errorf("sqloutbox: %w", err)
	}
	out := make([]string, 0, len(applied))
	for v := range applied {
		out = append(out, v)
	}
	sort.Strings(out)
	return out, nil
}

func errNoDB(what string) error {
	return fmt.Errorf("sqloutbox: %s needs a *sql.DB: pass one to New", what)
}
