package sqltable

import (
	"bytes"
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"sort"
	"strconv"
	"strings"
	"text/template"
	"time"
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
	dir := "migrations/" + s.dialect.String()
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
			return nil, fmt.Errorf("sqltable: migration %s: %w", n, err)
		}
		var b bytes.Buffer
		if err := t.Execute(&b, tmplData{s}); err != nil {
			return nil, fmt.Errorf("sqltable: migration %s: %w", n, err)
		}
		out = append(out, Migration{Version: n[len(dir)+1 : len(n)-len(".sql")], SQL: b.String()})
	}
	return out, nil
}

// SQL returns every migration as one script (on PostgreSQL with the schema's
// creation), for users who apply schema changes with goose, golang-migrate
// or by hand.
func (s *Store) SQL() (string, error) {
	ms, err := s.Migrations()
	if err != nil {
		return "", err
	}
	var b strings.Builder
	if s.dialect == Postgres && s.opts.Schema != "" {
		fmt.Fprintf(&b, "CREATE SCHEMA IF NOT EXISTS %s;\n\n", s.dialect.Quote(s.opts.Schema))
	}
	for i, m := range ms {
		if i > 0 {
			b.WriteString("\n")
		}
		fmt.Fprintf(&b, "-- idem sqltable migration %s\n%s", m.Version, m.SQL)
	}
	return b.String(), nil
}

// statementsOf splits a migration into its statements: every statement of
// the embedded files ends with a semicolon at the end of a line.
func statementsOf(script string) []string {
	var out []string
	var cur strings.Builder
	for line := range strings.SplitSeq(script, "\n") {
		trimmed := strings.TrimSpace(line)
		if cur.Len() == 0 && (trimmed == "" || strings.HasPrefix(trimmed, "--")) {
			continue
		}
		cur.WriteString(line)
		cur.WriteString("\n")
		if strings.HasSuffix(trimmed, ";") {
			out = append(out, strings.TrimSuffix(strings.TrimSpace(cur.String()), ";"))
			cur.Reset()
		}
	}
	if strings.TrimSpace(cur.String()) != "" {
		out = append(out, strings.TrimSpace(cur.String()))
	}
	return out
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
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("sqltable: migrate %s: %w", s.table, err)
	}
	defer func() { _ = conn.Close() }()
	switch s.dialect {
	case Postgres:
		err = s.migratePostgres(ctx, conn, ms)
	case MySQL:
		err = s.migrateMySQL(ctx, conn, ms)
	default:
		err = s.migrateSQLite(ctx, conn, ms)
	}
	if err != nil {
		return fmt.Errorf("sqltable: migrate %s: %w", s.table, err)
	}
	return nil
}

func (s *Store) migratePostgres(ctx context.Context, conn *sql.Conn, ms []Migration) error {
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	h := fnv.New64a()
	h.Write([]byte(s.lockName()))
	if _, err := tx.ExecContext(ctx, "SELECT pg_advisory_xact_lock($1)", int64(h.Sum64())); err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	if s.opts.Schema != "" {
		if _, err := tx.ExecContext(ctx, "CREATE SCHEMA IF NOT EXISTS "+s.dialect.Quote(s.opts.Schema)); err != nil {
			return fmt.Errorf("schema: %w", err)
		}
	}
	if _, err := tx.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+s.versionTable()+
		" (version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"); err != nil {
		return fmt.Errorf("version table: %w", err)
	}
	for _, m := range ms {
		res, err := tx.ExecContext(ctx, "INSERT INTO "+s.versionTable()+" (version) VALUES ($1) ON CONFLICT DO NOTHING", m.Version)
		if err != nil {
			return fmt.Errorf("%s: %w", m.Version, err)
		}
		if n, err := res.RowsAffected(); err != nil || n == 0 {
			if err != nil {
				return fmt.Errorf("%s: %w", m.Version, err)
			}
			continue // applied before
		}
		for _, st := range statementsOf(m.SQL) {
			if _, err := tx.ExecContext(ctx, st); err != nil {
				return fmt.Errorf("%s: %w", m.Version, err)
			}
		}
	}
	return tx.Commit()
}

func (s *Store) migrateMySQL(ctx context.Context, conn *sql.Conn, ms []Migration) error {
	var got sql.NullInt64
	if err := conn.QueryRowContext(ctx, "SELECT GET_LOCK(?, 60)", s.lockName()).Scan(&got); err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	if got.Int64 != 1 {
		return errors.New("lock: another Migrate held the lock for 60s; run it again")
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_, _ = conn.ExecContext(rctx, "DO RELEASE_LOCK(?)", s.lockName())
	}()
	if _, err := conn.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+s.versionTable()+
		" (version VARCHAR(255) NOT NULL PRIMARY KEY, applied_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB"); err != nil {
		return fmt.Errorf("version table: %w", err)
	}
	for _, m := range ms {
		var n int
		if err := conn.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+s.versionTable()+" WHERE version = ?", m.Version).Scan(&n); err != nil {
			return fmt.Errorf("%s: %w", m.Version, err)
		}
		if n > 0 {
			continue
		}
		for _, st := range statementsOf(m.SQL) {
			if _, err := conn.ExecContext(ctx, st); err != nil {
				return fmt.Errorf("%s: %w", m.Version, err)
			}
		}
		if _, err := conn.ExecContext(ctx, "INSERT INTO "+s.versionTable()+" (version) VALUES (?)", m.Version); err != nil {
			return fmt.Errorf("%s: %w", m.Version, err)
		}
	}
	return nil
}

func (s *Store) migrateSQLite(ctx context.Context, conn *sql.Conn, ms []Migration) (err error) {
	if _, err := conn.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil {
			_, _ = conn.ExecContext(context.WithoutCancel(ctx), "ROLLBACK")
		}
	}()
	if _, err := conn.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+s.versionTable()+
		" (version TEXT NOT NULL PRIMARY KEY, applied_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')))"); err != nil {
		return fmt.Errorf("version table: %w", err)
	}
	for _, m := range ms {
		res, err := conn.ExecContext(ctx, "INSERT INTO "+s.versionTable()+" (version) VALUES (?) ON CONFLICT DO NOTHING", m.Version)
		if err != nil {
			return fmt.Errorf("%s: %w", m.Version, err)
		}
		if n, err := res.RowsAffected(); err != nil || n == 0 {
			if err != nil {
				return fmt.Errorf("%s: %w", m.Version, err)
			}
			continue
		}
		for _, st := range statementsOf(m.SQL) {
			if _, err := conn.ExecContext(ctx, st); err != nil {
				return fmt.Errorf("%s: %w", m.Version, err)
			}
		}
	}
	if _, err := conn.ExecContext(ctx, "COMMIT"); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// MigrationStatus returns the applied versions, oldest first; empty when
// Migrate never ran.
func (s *Store) MigrationStatus(ctx context.Context) ([]string, error) {
	var (
		exists int
		err    error
		name   = s.opts.Table + "_migrations"
	)
	switch s.dialect {
	case Postgres:
		err = s.db.QueryRowContext(ctx, "SELECT CASE WHEN to_regclass($1) IS NULL THEN 0 ELSE 1 END", s.versionTable()).Scan(&exists)
	case MySQL:
		var schema any
		if s.opts.Schema != "" {
			schema = s.opts.Schema
		}
		err = s.db.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ?",
			schema, name).Scan(&exists)
	default:
		master := "sqlite_master"
		if s.opts.Schema != "" {
			master = s.dialect.Quote(s.opts.Schema) + ".sqlite_master"
		}
		err = s.db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+master+" WHERE type = 'table' AND name = ?", name).Scan(&exists)
	}
	if err != nil {
		return nil, fmt.Errorf("sqltable: migration status of %s: %w", s.table, err)
	}
	if exists == 0 {
		return nil, nil
	}
	rows, err := s.db.QueryContext(ctx, "SELECT version FROM "+s.versionTable()+" ORDER BY version")
	if err != nil {
		return nil, fmt.Errorf("sqltable: migration status of %s: %w", s.table, err)
	}
	defer func() { _ = rows.Close() }()
	var out []string
	for rows.Next() {
		var v string
		if err := rows.Scan(&v); err != nil {
			return nil, fmt.Errorf("sqltable: migration status of %s: %w", s.table, err)
		}
		out = append(out, v)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("sqltable: migration status of %s: %w", s.table, err)
	}
	return out, nil
}
