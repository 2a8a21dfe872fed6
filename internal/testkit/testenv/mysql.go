package testenv

import (
	"context"
	"database/sql"
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
