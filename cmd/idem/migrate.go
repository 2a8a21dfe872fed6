package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// pgFlags are the PostgreSQL flags shared by migrate and relay.
type pgFlags struct {
	url         string
	schema      string
	dedupTable  string
	outboxTable string
}

// The tables a command works on, for pgFlags.register.
const (
	withDedup  = 1 << iota // the dedup table: --dedup-table
	withOutbox             // the outbox table: --outbox-table
)

// register adds --postgres, --schema and the table flags of tables (a set of
// withDedup and withOutbox): a command lists only the flags it uses.
func (p *pgFlags) register(fs interface {
	StringVar(*string, string, string, string)
}, tables int) {
	fs.StringVar(&p.url, "postgres", envDefault("IDEM_POSTGRES_URL", ""), "PostgreSQL URL (or IDEM_POSTGRES_URL)")
	fs.StringVar(&p.schema, "schema", envDefault("IDEM_SCHEMA", "public"), "schema of the tables (or IDEM_SCHEMA)")
	if tables&withDedup != 0 {
		fs.StringVar(&p.dedupTable, "dedup-table", "processed_events", "table of the dedup marks (pgtable)")
	}
	if tables&withOutbox != 0 {
		fs.StringVar(&p.outboxTable, "outbox-table", "outbox", "table of the outbox (pgoutbox)")
	}
}

// connect opens a pool and checks that the server answers.
func (p *pgFlags) connect(ctx context.Context) (*pgxpool.Pool, error) {
	if p.url == "" {
		return nil, errors.New("--postgres (or IDEM_POSTGRES_URL) is required")
	}
	cfg, err := pgxpool.ParseConfig(p.url)
	if err != nil {
		return nil, fmt.Errorf("--postgres: %w", err)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("--postgres: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("PostgreSQL at %s is unreachable: %w", redactURL(p.url), err)
	}
	return pool, nil
}

// redactURL hides a password in a connection URL.
func redactURL(u string) string {
	cfg, err := pgx.ParseConfig(u)
	if err != nil {
		return "(the --postgres URL)"
	}
	return fmt.Sprintf("%s:%d/%s", cfg.Host, cfg.Port, cfg.Database)
}

// noDB is a pgtable.DB that is never called: pgtable.Store needs one to
// render its SQL, which touches no database.
type noDB struct{}

var errNoDB = errors.New("no database")

func (noDB) Begin(context.Context) (pgx.Tx, error) { return nil, errNoDB }
func (noDB) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	return pgconn.CommandTag{}, errNoDB
}
func (noDB) Query(context.Context, string, ...any) (pgx.Rows, error) { return nil, errNoDB }
func (noDB) QueryRow(context.Context, string, ...any) pgx.Row        { return errRow{} }
func (noDB) SendBatch(context.Context, *pgx.Batch) pgx.BatchResults  { return nil }

type errRow struct{}

func (errRow) Scan(...any) error { return errNoDB }

const migrateSynopsis = `migrate [flags] up|status|sql

  up      apply the pgtable (dedup) and pgoutbox (outbox) migrations; idempotent,
          safe to run from several processes at once (advisory locks)
  status  show the applied versions of both; exits 3 when a migration is
          pending, so that a deploy can check the schema before it starts
  sql     print both schemas as SQL, for goose, golang-migrate or by hand
          (needs no database)

  With --driver mysql|sqlite|postgres and --dsn, the same for the dedup
  table of sqltable (database/sql) instead: MySQL/MariaDB, SQLite, or
  PostgreSQL through database/sql.`

func runMigrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("migrate", migrateSynopsis, stderr)
	var pg pgFlags
	pg.register(fs, withDedup|withOutbox)
	keepKeys := fs.Bool("keep-keys", false, "the dedup table keeps each key's scope and id readable (pgtable.Options.KeepKeys; give the application's setting: converting an older table without it drops them)")
	driver := fs.String("driver", envDefault("IDEM_DRIVER", ""), "migrate the dedup table of sqltable (database/sql) instead: mysql, sqlite or postgres (or IDEM_DRIVER); needs --dsn")
	dsn := fs.String("dsn", envDefault("IDEM_DSN", ""), "the database/sql data source name of --driver (or IDEM_DSN), e.g. user@tcp(host:3306)/db or file:app.db")
	partitioned := fs.Bool("partitioned", false, "the dedup table is partitioned by expiry (pgtable.Options.Partitioned; give the application's setting)")
	orderedKeys := fs.Bool("time-ordered-keys", false, "the dedup table keys the rows of UUIDv6/v7 ids by their time (pgtable.Options.TimeOrderedKeys; give the application's setting: converting an older table keys its rows that way only with it)")
	// Accept the action before or after the flags.
	var action string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		action, args = args[0], args[1:]
	}
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	rest := fs.Args()
	if action == "" && len(rest) > 0 {
		action, rest = rest[0], rest[1:]
	}
	if len(rest) > 0 {
		return usageError(fs, "unexpected argument %q", rest[0])
	}
	switch action {
	case "up", "status", "sql":
	case "":
		return usageError(fs, "missing action: up, status or sql")
	default:
		return usageError(fs, "unknown action %q: want up, status or sql", action)
	}

	if *driver != "" {
		if *orderedKeys {
			return usageError(fs, "--time-ordered-keys is a setting of pgtable, not of the sqltable store of --driver")
		}
		schema := ""
		fs.Visit(func(f *flag.Flag) {
			if f.Name == "schema" {
				schema = pg.schema
			}
		})
		return sqlMigrate(ctx, action, *driver, *dsn, schema, pg.dedupTable, *keepKeys, stdout)
	}

	var db pgtable.DB = noDB{}
	var pool *pgxpool.Pool
	if action != "sql" {
		var err error
		pool, err = pg.connect(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		db = pool
	}
	store, err := pgtable.New(db, pgtable.Options{Schema: pg.schema, Table: pg.dedupTable, KeepKeys: *keepKeys,
		Partitioned: *partitioned, TimeOrderedKeys: *orderedKeys})
	if err != nil {
		return err
	}
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: pg.schema, Table: pg.outboxTable})
	if err != nil {
		return err
	}

	switch action {
	case "sql":
		dsql, err := store.SQL()
		if err != nil {
			return err
		}
		osql, err := ob.SQL()
		if err != nil {
			return err
		}
		fprintf(stdout, "-- idem dedup marks (pgtable): %s\n%s\n", store.Table(), strings.TrimRight(dsql, "\n"))
		fprintf(stdout, "\n-- idem outbox (pgoutbox): %s\n%s\n", ob.Table(), strings.TrimRight(osql, "\n"))
		return nil
	case "up":
		if err := store.Migrate(ctx); err != nil {
			return fmt.Errorf("migrate %s: %w", store.Table(), err)
		}
		if err := ob.Migrate(ctx); err != nil {
			return fmt.Errorf("migrate %s: %w", ob.Table(), err)
		}
	}
	return printStatus(ctx, stdout, store, ob)
}

func printStatus(ctx context.Context, w io.Writer, store *pgtable.Store, ob *pgoutbox.Outbox) error {
	dm, err := store.Migrations()
	if err != nil {
		return err
	}
	dv, err := store.MigrationStatus(ctx)
	if err != nil {
		return fmt.Errorf("status of %s: %w", store.Table(), err)
	}
	om, err := ob.Migrations()
	if err != nil {
		return err
	}
	ov, err := ob.MigrationStatus(ctx)
	if err != nil {
		return fmt.Errorf("status of %s: %w", ob.Table(), err)
	}
	fprintf(w, "%s (dedup, pgtable): %s\n", store.Table(), describe(len(dm), dv))
	fprintf(w, "%s (outbox, pgoutbox): %s\n", ob.Table(), describe(len(om), ov))
	if len(dv) < len(dm) || len(ov) < len(om) {
		return errPending
	}
	return nil
}

func describe(known int, applied []string) string {
	if len(applied) == 0 {
		return fmt.Sprintf("not migrated (%d migrations pending)", known)
	}
	s := fmt.Sprintf("version %s (%d of %d applied", applied[len(applied)-1], len(applied), known)
	if p := known - len(applied); p > 0 {
		s += fmt.Sprintf(", %d pending", p)
	}
	return s + ")"
}
