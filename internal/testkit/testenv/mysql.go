package testenv

import (
	"context"
	"database/sql"
	"strconv"
	"strings"
	"testing"
	"time"

	// The MySQL and MariaDB driver, for MySQL.
	_ "github.com/go-sql-driver/mysql"
)

// MySQLDSN is the go-sql-driver/mysql DSN of the test MySQL or MariaDB
// database.
func MySQLDSN() string { return env("IDEM_TEST_MYSQL_DSN", "root@tcp(127.0.0.1:3306)/test") }

// MySQL returns a *sql.DB on the test MySQL or MariaDB database, closed
// when the test ends. params, when not empty, are appended to the DSN's
// query (for example "tx_isolation=%27READ-COMMITTED%27").
func MySQL(t testing.TB, params string) *sql.DB {
	t.Helper()
	dsn := MySQLDSN()
	if params != "" {
		sep := "?"
		if strings.Contains(dsn, "?") {
			sep = "&"
		}
		dsn += sep + params
	}
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatalf("IDEM_TEST_MYSQL_DSN: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		unavailable(t, "MySQL/MariaDB at "+MySQLDSN(), err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// MySQLLockWait is a transaction that waits for an InnoDB lock.
type MySQLLockWait struct {
	Thread int64  // the connection's id (CONNECTION_ID())
	Table  string // the table of the lock it waits for, unquoted, without its database
}

// MySQLLockWaits returns the transactions of db's server that wait for a
// lock, from SHOW ENGINE INNODB STATUS. That report is built when asked;
// information_schema.innodb_trx is not a fit for polling: the server
// refreshes its copy only after 100ms without a reader, so a test asking
// every few milliseconds (or two tests asking in turn) reads a stale list
// for good.
func MySQLLockWaits(ctx context.Context, db *sql.DB) ([]MySQLLockWait, error) {
	var typ, name, status string
	if err := db.QueryRowContext(ctx, "SHOW ENGINE INNODB STATUS").Scan(&typ, &name, &status); err != nil {
		return nil, err
	}
	var out []MySQLLockWait
	for _, trx := range strings.Split(status, "---TRANSACTION ")[1:] {
		_, wait, ok := strings.Cut(trx, "TRX HAS BEEN WAITING")
		if !ok {
			continue
		}
		var w MySQLLockWait
		for _, line := range strings.Split(trx, "\n") {
			for _, prefix := range []string{"MariaDB thread id ", "MySQL thread id "} {
				if rest, ok := strings.CutPrefix(line, prefix); ok {
					id, _, _ := strings.Cut(rest, ",")
					w.Thread, _ = strconv.ParseInt(id, 10, 64)
				}
			}
		}
		if _, rest, ok := strings.Cut(wait, " of table `"); ok {
			if _, table, ok := strings.Cut(rest, "`.`"); ok {
				w.Table, _, _ = strings.Cut(table, "`")
			}
		}
		out = append(out, w)
	}
	return out, nil
}
