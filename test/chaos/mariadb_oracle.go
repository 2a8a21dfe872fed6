package chaos

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"log"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// The MariaDB side of the matrix (mariadb_*.go): dedup/sqltable on
// MySQL/MariaDB through go-sql-driver/mysql. The effect must commit in the
// claim's transaction, so the effects table (myOracle) lives on the MariaDB
// server the claim is on — a database of its own on the shared server, or on
// the throwaway one the cell crashes, read there after recovery.

// storeMySQL is the store of the MariaDB cells: the claim in
// dedup/sqltable and the effect in one MariaDB transaction.
const storeMySQL = "sqltable-mariadb"

func init() {
	// The driver logs every connection a fault broke ("unexpected EOF",
	// "invalid connection") to stderr; the cell's line says what happened.
	_ = mysql.SetLogger(log.New(io.Discard, "", 0))
}

// myDSN returns dsn with database as its default database and the dial
// timeout the cells use.
func myDSN(dsn, database string) (string, error) {
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return "", fmt.Errorf("MySQL DSN %q: %w", dsn, err)
	}
	cfg.DBName = database
	cfg.Timeout = 3 * time.Second
	return cfg.FormatDSN(), nil
}

// myOpen opens a *sql.DB of at most conns connections on dsn and checks it
// answers.
func myOpen(ctx context.Context, dsn string, conns int) (*sql.DB, error) {
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, fmt.Errorf("MySQL DSN %q: %w", dsn, err)
	}
	conn, err := mysql.NewConnector(cfg)
	if err != nil {
		return nil, err
	}
	db := sql.OpenDB(conn)
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := db.PingContext(pctx); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("MariaDB at %s: %w", cfg.Addr, err)
	}
	return db, nil
}

// mySharedDSN is the shared MariaDB (IDEM_TEST_MYSQL_DSN).
func mySharedDSN() string { return testenv.MySQLDSN() }

// myOracle is the effects table of a MariaDB cell: one row per applied
// effect, no unique constraint, in a database of its own (where the cell's
// sqltable store lives too); Drop removes both.
type myOracle struct {
	db       *sql.DB // a root connection of the server, no default database
	database string
	table    string // quoted, qualified
}

// newMyOracle creates a fresh database named after the cell and its
// effects table, through db (a connection as root).
func newMyOracle(ctx context.Context, db *sql.DB, cell string, seed uint64) (*myOracle, error) {
	name := fmt.Sprintf("chaos_%s_%d", sanitize(cell), seed%1_000_000_007)
	o := &myOracle{db: db, database: name, table: "`" + name + "`.`effects`"}
	for _, q := range []string{
		"DROP DATABASE IF EXISTS `" + name + "`",
		"CREATE DATABASE `" + name + "`",
		"CREATE TABLE " + o.table + " (id varchar(100) NOT NULL, worker varchar(100) NOT NULL DEFAULT '', at datetime(6) NOT NULL DEFAULT current_timestamp(6), KEY (id)) ENGINE=InnoDB",
	} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			return nil, fmt.Errorf("chaos: MariaDB oracle: %w", err)
		}
	}
	return o, nil
}

// effectSQL is the statement that records an effect (placeholders ?).
func (o *myOracle) effectSQL() string {
	return "INSERT INTO " + o.table + " (id, worker) VALUES (?, ?)"
}

// record writes one effect row for id in tx (the claim's transaction).
func (o *myOracle) record(ctx context.Context, tx *sql.Tx, id, worker string) error {
	_, err := tx.ExecContext(ctx, o.effectSQL(), id, worker)
	return err
}

// distinct returns the number of ids with an effect.
func (o *myOracle) distinct(ctx context.Context) (n int, err error) {
	err = o.db.QueryRowContext(ctx, "SELECT count(DISTINCT id) FROM "+o.table).Scan(&n)
	return n, err
}

// check returns the oracle's verdict over the inputs that must have an
// effect: duplicates are ids with more than one row (over every row), lost
// are ids in must without a row.
func (o *myOracle) check(ctx context.Context, must []string) (duplicates, lost int, err error) {
	err = o.db.QueryRowContext(ctx, "SELECT count(*) FROM (SELECT id FROM "+o.table+" GROUP BY id HAVING count(*) > 1) d").Scan(&duplicates)
	if err != nil {
		return 0, 0, fmt.Errorf("chaos: MariaDB oracle duplicates: %w", err)
	}
	rows, err := o.db.QueryContext(ctx, "SELECT DISTINCT id FROM "+o.table)
	if err != nil {
		return 0, 0, fmt.Errorf("chaos: MariaDB oracle lost: %w", err)
	}
	defer func() { _ = rows.Close() }()
	seen := map[string]bool{}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return 0, 0, fmt.Errorf("chaos: MariaDB oracle lost: %w", err)
		}
		seen[id] = true
	}
	if err := rows.Err(); err != nil {
		return 0, 0, fmt.Errorf("chaos: MariaDB oracle lost: %w", err)
	}
	for _, id := range must {
		if !seen[id] {
			lost++
		}
	}
	return duplicates, lost, nil
}

// drop removes the oracle's database and everything in it.
func (o *myOracle) drop(ctx context.Context) error {
	_, err := o.db.ExecContext(ctx, "DROP DATABASE IF EXISTS `"+o.database+"`")
	return err
}

// myCheck runs the oracle with retries (the reads that follow a fault may
// first meet a connection it broke) and fills res.
func myCheck(ctx context.Context, o *myOracle, must []string, res *Result) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		d, l, err := o.check(cctx, must)
		cancel()
		if err == nil {
			res.Duplicates, res.Lost = d, l
			return nil
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return err
		}
		if err := sleepCtx(ctx, 100*time.Millisecond); err != nil {
			return err
		}
	}
}
