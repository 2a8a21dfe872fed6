// Package sqlmigrate applies embedded, per-dialect schema migrations through
// database/sql: it renders the templates of one directory, splits them into
// statements, applies the ones not recorded yet under a lock (an advisory
// transaction lock on PostgreSQL, GET_LOCK on MySQL and MariaDB, BEGIN
// IMMEDIATE on SQLite) and records their versions in a version table.
//
// It imports no driver; the packages that use it keep their own templates,
// version table and lock names.
package sqlmigrate

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"sort"
	"strings"
	"text/template"
	"time"

	"github.com/idemkit/idem/internal/sqldialect"
)

// Migration is one rendered schema change.
type Migration struct {
	Version string // the file name without .sql
	SQL     string
}

// Shape is a package's own migration type: a struct with Migration's
// fields (sqltable.Migration, sqloutbox.Migration, kafkasql.Migration),
// which Render returns and Apply and Script take as they are.
type Shape interface {
	~struct {
		Version string
		SQL     string
	}
}

// Render parses every dir/*.sql of fsys as a text/template, executes it with
// data and returns the migrations ordered by file name, as the caller's
// own migration type M.
func Render[M Shape](fsys fs.FS, dir string, data any) ([]M, error) {
	names, err := fs.Glob(fsys, dir+"/*.sql")
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	out := make([]M, 0, len(names))
	for _, n := range names {
		raw, err := fs.ReadFile(fsys, n)
		if err != nil {
			return nil, err
		}
		t, err := template.New(n).Parse(string(raw))
		if err != nil {
			return nil, fmt.Errorf("migration %s: %w", n, err)
		}
		var b bytes.Buffer
		if err := t.Execute(&b, data); err != nil {
			return nil, fmt.Errorf("migration %s: %w", n, err)
		}
		out = append(out, M{Version: strings.TrimSuffix(n[len(dir)+1:], ".sql"), SQL: b.String()})
	}
	return out, nil
}

// Script joins ms into one script for users who apply schema changes with
// goose, golang-migrate or by hand: each migration under a comment naming
// it ("-- idem <what> migration <version>"), after the creation of
// quotedSchema when it is not empty.
func Script[M Shape](what, quotedSchema string, ms []M) string {
	var b strings.Builder
	if quotedSchema != "" {
		fmt.Fprintf(&b, "CREATE SCHEMA IF NOT EXISTS %s;\n\n", quotedSchema)
	}
	for i, m := range ms {
		if i > 0 {
			b.WriteString("\n")
		}
		fmt.Fprintf(&b, "-- idem %s migration %s\n%s", what, Migration(m).Version, Migration(m).SQL)
	}
	return b.String()
}

// Statements splits a script into its statements: full-line comments are
// dropped and a statement ends with ";" at the end of a line. The ";" is not
// part of the statement.
func Statements(script string) []string {
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

// Key hashes a lock name into a PostgreSQL advisory lock key (FNV-1a, 64 bits).
func Key(name string) int64 {
	h := fnv.New64a()
	h.Write([]byte(name))
	return int64(h.Sum64())
}

// Target says where and how Apply records versions and which lock it holds.
type Target struct {
	Dialect sqldialect.Dialect
	// Schema is the PostgreSQL schema Apply creates before anything else,
	// unquoted. Empty creates none; ignored on the other dialects.
	Schema string
	// VersionTable is the quoted, qualified table recording the versions.
	VersionTable string
	// VersionColumns is what follows the table name in the version table's
	// CREATE TABLE IF NOT EXISTS. Defaults to a version primary key and an
	// applied_at column defaulting to the current time, in the dialect's
	// types.
	VersionColumns string
	// Record inserts one version, its only argument, into VersionTable. On
	// PostgreSQL and SQLite it runs before the migration's statements and
	// must do nothing when the version is there (no row affected means
	// applied); on MySQL it runs after them. Defaults to an INSERT of the
	// version column alone, ignoring a conflict on PostgreSQL and SQLite.
	Record string
	// LockName names the lock Apply holds: the advisory lock key on
	// PostgreSQL is Key(LockName), the GET_LOCK name on MySQL is LockName.
	LockName string
	// MySQLLock, when set, is the SQL expression naming the GET_LOCK lock
	// in place of LockName, with MySQLLockArgs as its arguments.
	MySQLLock     string
	MySQLLockArgs []any
}

func (t Target) columns() string {
	if t.VersionColumns != "" {
		return t.VersionColumns
	}
	switch t.Dialect {
	case sqldialect.Postgres:
		return " (version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
	case sqldialect.MySQL:
		return " (version VARCHAR(255) NOT NULL PRIMARY KEY, applied_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB"
	default:
		return " (version TEXT NOT NULL PRIMARY KEY, applied_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')))"
	}
}

func (t Target) record() string {
	if t.Record != "" {
		return t.Record
	}
	switch t.Dialect {
	case sqldialect.Postgres:
		return "INSERT INTO " + t.VersionTable + " (version) VALUES ($1) ON CONFLICT DO NOTHING"
	case sqldialect.MySQL:
		return "INSERT INTO " + t.VersionTable + " (version) VALUES (?)"
	default:
		return "INSERT INTO " + t.VersionTable + " (version) VALUES (?) ON CONFLICT DO NOTHING"
	}
}

// Apply applies the migrations of ms not recorded in t.VersionTable yet, in
// order, on one connection of db. On PostgreSQL it runs in one transaction
// under a transaction-scoped advisory lock; on MySQL and MariaDB under
// GET_LOCK (DDL commits by itself there: each version is recorded after its
// statements, so an interrupted migration is applied again); on SQLite in
// one BEGIN IMMEDIATE transaction. Errors name the step ("lock", "schema",
// "version table", "begin", "commit") or the migration's version.
func Apply[M Shape](ctx context.Context, db *sql.DB, t Target, own []M) error {
	ms := make([]Migration, len(own))
	for i, m := range own {
		ms[i] = Migration(m)
	}
	conn, err := db.Conn(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	switch t.Dialect {
	case sqldialect.Postgres:
		return applyPostgres(ctx, conn, t, ms)
	case sqldialect.MySQL:
		return applyMySQL(ctx, conn, t, ms)
	default:
		return applySQLite(ctx, conn, t, ms)
	}
}

// applyRecordFirst records each version before its statements, in the
// transaction that runs them, and skips a version already recorded.
func applyRecordFirst(ctx context.Context, ex interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}, t Target, ms []Migration) error {
	if _, err := ex.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+t.VersionTable+t.columns()); err != nil {
		return fmt.Errorf("version table: %w", err)
	}
	for _, m := range ms {
		res, err := ex.ExecContext(ctx, t.record(), m.Version)
		if err != nil {
			return fmt.Errorf("%s: %w", m.Version, err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return fmt.Errorf("%s: %w", m.Version, err)
		}
		if n == 0 {
			continue // applied before
		}
		for _, st := range Statements(m.SQL) {
			if _, err := ex.ExecContext(ctx, st); err != nil {
				return fmt.Errorf("%s: %w", m.Version, err)
			}
		}
	}
	return nil
}

func applyPostgres(ctx context.Context, conn *sql.Conn, t Target, ms []Migration) error {
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, "SELECT pg_advisory_xact_lock($1)", Key(t.LockName)); err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	if t.Schema != "" {
		if _, err := tx.ExecContext(ctx, "CREATE SCHEMA IF NOT EXISTS "+sqldialect.Postgres.Quote(t.Schema)); err != nil {
			return fmt.Errorf("schema: %w", err)
		}
	}
	if err := applyRecordFirst(ctx, tx, t, ms); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

func applyMySQL(ctx context.Context, conn *sql.Conn, t Target, ms []Migration) error {
	lock, args := "?", []any{t.LockName}
	if t.MySQLLock != "" {
		lock, args = t.MySQLLock, t.MySQLLockArgs
	}
	var got sql.NullInt64
	if err := conn.QueryRowContext(ctx, "SELECT GET_LOCK("+lock+", 60)", args...).Scan(&got); err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	if got.Int64 != 1 {
		return errors.New("lock: another Migrate held the lock for 60s; run it again")
	}
	defer func() {
		// The lock ends with the connection too; release it so that the
		// connection goes back to the pool clean.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_, _ = conn.ExecContext(rctx, "DO RELEASE_LOCK("+lock+")", args...)
	}()
	if _, err := conn.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+t.VersionTable+t.columns()); err != nil {
		return fmt.Errorf("version table: %w", err)
	}
	for _, m := range ms {
		var n int
		if err := conn.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+t.VersionTable+" WHERE version = ?", m.Version).Scan(&n); err != nil {
			return fmt.Errorf("%s: %w", m.Version, err)
		}
		if n > 0 {
			continue
		}
		for _, st := range Statements(m.SQL) {
			if _, err := conn.ExecContext(ctx, st); err != nil {
				return fmt.Errorf("%s: %w", m.Version, err)
			}
		}
		if _, err := conn.ExecContext(ctx, t.record(), m.Version); err != nil {
			return fmt.Errorf("%s: %w", m.Version, err)
		}
	}
	return nil
}

func applySQLite(ctx context.Context, conn *sql.Conn, t Target, ms []Migration) (err error) {
	if _, err := conn.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil {
			_, _ = conn.ExecContext(context.WithoutCancel(ctx), "ROLLBACK")
		}
	}()
	if err := applyRecordFirst(ctx, conn, t, ms); err != nil {
		return err
	}
	if _, err := conn.ExecContext(ctx, "COMMIT"); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// Applied returns the versions recorded in versionTable (quoted, qualified),
// oldest first; none when the table does not exist. schema and name are
// the table's schema (empty: the connection's) and bare name, unquoted.
func Applied(ctx context.Context, db *sql.DB, d sqldialect.Dialect, schema, name, versionTable string) ([]string, error) {
	var (
		exists int
		err    error
	)
	switch d {
	case sqldialect.Postgres:
		err = db.QueryRowContext(ctx, "SELECT CASE WHEN to_regclass($1) IS NULL THEN 0 ELSE 1 END", versionTable).Scan(&exists)
	case sqldialect.MySQL:
		var s any
		if schema != "" {
			s = schema
		}
		err = db.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = COALESCE(?, DATABASE()) AND table_name = ?",
			s, name).Scan(&exists)
	default:
		master := "sqlite_master"
		if schema != "" {
			master = d.Quote(schema) + ".sqlite_master"
		}
		err = db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+master+" WHERE type = 'table' AND name = ?", name).Scan(&exists)
	}
	if err != nil {
		return nil, err
	}
	if exists == 0 {
		return nil, nil
	}
	rows, err := db.QueryContext(ctx, "SELECT version FROM "+versionTable+" ORDER BY version")
	if err != nil {
		return nil, err
	}
	defer func() { _ = rows.Close() }()
	var out []string
	for rows.Next() {
		var v string
		if err := rows.Scan(&v); err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	sort.Strings(out) // byte order, whatever the column's collation
	return out, nil
}
