package main

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestMigrateDriver: --driver and --dsn run the migrations of the dedup
// table on database/sql, on SQLite and on MariaDB: status before up exits
// 3, up applies, status after exits 0, sql prints the dialect's schema.
func TestMigrateDriver(t *testing.T) {
	ctx := context.Background()
	mysqlTable := testenv.Name("dedup")
	cases := []struct {
		driver, dsn, table, want string
	}{
		{"sqlite", "file:" + filepath.Join(t.TempDir(), "app.db") + "?_txlock=immediate", "processed_events", "WITHOUT ROWID"},
		{"mysql", testenv.MySQLDSN(), mysqlTable, "ENGINE = InnoDB"},
	}
	for _, c := range cases {
		t.Run(c.driver, func(t *testing.T) {
			if c.driver == "mysql" {
				db := testenv.MySQL(t, "") // skips when MariaDB is down
				t.Cleanup(func() {
					_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS `"+c.table+"`, `"+c.table+"_migrations`")
				})
			}
			args := []string{"--driver", c.driver, "--dsn", c.dsn, "--dedup-table", c.table}
			code, out, errOut := runCmd(ctx, t, append([]string{"migrate", "status"}, args...)...)
			if code != exitPending || !strings.Contains(out, "not migrated") {
				t.Fatalf("status before up: exit %d, want %d\n%s%s", code, exitPending, out, errOut)
			}
			code, out, errOut = runCmd(ctx, t, append([]string{"migrate", "up"}, args...)...)
			if code != 0 || !strings.Contains(out, "(dedup, sqltable "+c.driver+"): version 0001_processed_events (1 of 1 applied)") {
				t.Fatalf("up: exit %d\n%s%s", code, out, errOut)
			}
			code, _, errOut = runCmd(ctx, t, append([]string{"migrate", "status"}, args...)...)
			if code != 0 {
				t.Fatalf("status after up: exit %d\n%s", code, errOut)
			}
			code, out, errOut = runCmd(ctx, t, "migrate", "sql", "--driver", c.driver, "--dedup-table", c.table)
			if code != 0 || !strings.Contains(out, c.want) || !strings.Contains(out, c.table) {
				t.Fatalf("sql: exit %d, want the %s schema of %s\n%s%s", code, c.driver, c.table, out, errOut)
			}
		})
	}
	if code, _, errOut := runCmd(ctx, t, "migrate", "up", "--driver", "oracle", "--dsn", "x"); code == 0 || !strings.Contains(errOut, "--driver") {
		t.Errorf("an unknown driver: exit %d\n%s", code, errOut)
	}
}
