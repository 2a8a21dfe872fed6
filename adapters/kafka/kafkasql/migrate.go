package kafkasql

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
			return nil, fmt.Errorf("kafkasql: migration %s: %w", n, err)
		}
		var b bytes.Buffer
		if err := t.Execute(&b, tmplData{o}); err != nil {
			return nil, fmt.Errorf("kafkasql: migration %s: %w", n, err)
		}
		out = append(out, Migration{Version: n[len(dir)+1 : len(n)-len(".sql")], SQL: b.String()})
	}
	return out, nil
}

// SQL returns every migration as one script (on PostgreSQL with the
// schema's creation), for goose, golang-migrate or by hand.
func (o *Offsets) SQL() (string, error) {
	ms, err := o.Migrations()
	if err != nil {
		return "", err
	}
	var b strings.Builder
	if o.dialect == Postgres && o.opts.Schema != "" {
		fmt.Fprintf(&b, "CREATE SCHEMA IF NOT EXISTS %s;\n\n", o.dialect.Quote(o.opts.Schema))
	}
	for i, m := range ms {
		if i > 0 {
			b.WriteString("\n")
		}
		fmt.Fprintf(&b, "-- idem kafkasql migration %s\n%s", m.Version, m.SQL)
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
	if s := strings.TrimSpace(cur.String()); s != "" {
		out = append(out, s)
	}
	return out
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
	conn, err := o.db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("kafkasql: migrate %s: %w", o.table, err)
	}
	defer func() { _ = conn.Close() }()
	switch o.dialect {
	case Postgres:
		err = o.migratePostgres(ctx, conn, ms)
	case MySQL:
		err = o.migrateMySQL(ctx, conn, ms)
	default:
		err = o.migrateSQLite(ctx, conn, ms)
	}
	if err != nil {
		return fmt.Errorf("kafkasql: migrate %s: %w", o.table, err)
	}
	return nil
}

// applyAll runs the migrations not recorded yet: applied reports whether a
// version is recorded, record records it (before or after its statements,
// as the dialect's transaction allows).
func applyAll(ctx context.Context, conn *sql.Conn, ms []Migration, applied func(Migration) (bool, error), record func(Migration) error) error {
	for _, m := range ms {
		done, err := applied(m)
		if err != nil {
			return fmt.Errorf("%s: %w", m.Version, err)
		}
		if done {
			continue
		}
		for _, st := range statementsOf(m.SQL) {
			if _, err := conn.ExecContext(ctx, st); err != nil {
				return fmt.Errorf("%s: %w", m.Version, err)
			}
		}
		if err := record(m); err != nil {
			return fmt.Errorf("%s: %w", m.Version, err)
		}
	}
	return nil
}

func (o *Offsets) migratePostgres(ctx context.Context, conn *sql.Conn, ms []Migration) (err error) {
	if _, err := conn.ExecContext(ctx, "BEGIN"); err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil {
			_, _ = conn.ExecContext(context.WithoutCancel(ctx), "ROLLBACK")
		}
	}()
	h := fnv.New64a()
	h.Write([]byte(o.lockName()))
	if _, err := conn.ExecContext(ctx, "SELECT pg_advisory_xact_lock($1)", int64(h.Sum64())); err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	if o.opts.Schema != "" {
		if _, err := conn.ExecContext(ctx, "CREATE SCHEMA IF NOT EXISTS "+o.dialect.Quote(o.opts.Schema)); err != nil {
			return fmt.Errorf("schema: %w", err)
		}
	}
	if _, err := conn.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+o.versionTable()+
		" (version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"); err != nil {
		return fmt.Errorf("version table: %w", err)
	}
	err = applyAll(ctx, conn, ms, o.appliedOn(ctx, conn), o.recordOn(ctx, conn))
	if err != nil {
		return err
	}
	if _, err := conn.ExecContext(ctx, "COMMIT"); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

func (o *Offsets) migrateMySQL(ctx context.Context, conn *sql.Conn, ms []Migration) error {
	var got sql.NullInt64
	if err := conn.QueryRowContext(ctx, "SELECT GET_LOCK(?, 60)", o.lockName()).Scan(&got); err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	if got.Int64 != 1 {
		return errors.New("lock: another Migrate held the lock for 60s; run it again")
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_, _ = conn.ExecContext(rctx, "DO RELEASE_LOCK(?)", o.lockName())
	}()
	if _, err := conn.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+o.versionTable()+
		" (version VARCHAR(255) NOT NULL PRIMARY KEY, applied_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB"); err != nil {
		return fmt.Errorf("version table: %w", err)
	}
	return applyAll(ctx, conn, ms, o.appliedOn(ctx, conn), o.recordOn(ctx, conn))
}

func (o *Offsets) migrateSQLite(ctx context.Context, conn *sql.Conn, ms []Migration) (err error) {
	if _, err := conn.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() {
		if err != nil {
			_, _ = conn.ExecContext(context.WithoutCancel(ctx), "ROLLBACK")
		}
	}()
	if _, err := conn.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+o.versionTable()+
		" (version TEXT NOT NULL PRIMARY KEY, applied_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')))"); err != nil {
		return fmt.Errorf("version table: %w", err)
	}
	if err := applyAll(ctx, conn, ms, o.appliedOn(ctx, conn), o.recordOn(ctx, conn)); err != nil {
		return err
	}
	if _, err := conn.ExecContext(ctx, "COMMIT"); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

func (o *Offsets) appliedOn(ctx context.Context, conn *sql.Conn) func(Migration) (bool, error) {
	return func(m Migration) (bool, error) {
		var n int
		err := conn.QueryRowContext(ctx, o.dialect.Rebind("SELECT COUNT(*) FROM "+o.versionTable()+" WHERE version = ?"), m.Version).Scan(&n)
		return n > 0, err
	}
}

func (o *Offsets) recordOn(ctx context.Context, conn *sql.Conn) func(Migration) error {
	return func(m Migration) error {
		_, err := conn.ExecContext(ctx, o.dialect.Rebind("INSERT INTO "+o.versionTable()+" (version) VALUES (?)"), m.Version)
		return err
	}
}
