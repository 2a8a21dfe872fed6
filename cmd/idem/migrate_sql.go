package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"strings"
	"time"

	// The database/sql drivers of `idem migrate --driver`.
	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"
	_ "modernc.org/sqlite"

	"github.com/idemkit/idem/dedup/sqltable"
)

// sqlDrivers maps --driver to the database/sql driver and the sqltable
// dialect.
var sqlDrivers = map[string]struct {
	name    string
	dialect sqltable.Dialect
}{
	"mysql":    {"mysql", sqltable.MySQL},
	"sqlite":   {"sqlite", sqltable.SQLite},
	"postgres": {"pgx", sqltable.Postgres},
}

// sqlMigrate is `idem migrate --driver`: the migrations of the dedup store
// on database/sql (dedup/sqltable). schema is "" unless --schema was given.
func sqlMigrate(ctx context.Context, action, driver, dsn, schema, table string, keepKeys bool, stdout io.Writer) error {
	d, ok := sqlDrivers[driver]
	if !ok {
		return fmt.Errorf("--driver %q: want mysql, sqlite or postgres", driver)
	}
	if dsn == "" && action != "sql" {
		return fmt.Errorf("--dsn (or IDEM_DSN) is required with --driver %s", driver)
	}
	db, err := sql.Open(d.name, dsn)
	if err != nil {
		return fmt.Errorf("--dsn: %w", err)
	}
	defer func() { _ = db.Close() }()
	store, err := sqltable.New(db, d.dialect, sqltable.Options{Schema: schema, Table: table, KeepKeys: keepKeys})
	if err != nil {
		return err
	}
	if action == "sql" {
		script, err := store.SQL()
		if err != nil {
			return err
		}
		fprintf(stdout, "-- idem dedup marks (sqltable, %s): %s\n%s\n", driver, store.Table(), strings.TrimRight(script, "\n"))
		return nil
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := db.PingContext(pctx); err != nil {
		return fmt.Errorf("%s database is unreachable: %w", driver, err)
	}
	if action == "up" {
		if err := store.Migrate(ctx); err != nil {
			return fmt.Errorf("migrate %s: %w", store.Table(), err)
		}
	}
	ms, err := store.Migrations()
	if err != nil {
		return err
	}
	applied, err := store.MigrationStatus(ctx)
	if err != nil {
		return fmt.Errorf("status of %s: %w", store.Table(), err)
	}
	fprintf(stdout, "%s (dedup, sqltable %s): %s\n", store.Table(), driver, describe(len(ms), applied))
	if len(applied) < len(ms) {
		return errPending
	}
	return nil
}
