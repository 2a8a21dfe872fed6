package sqlmigrate

import (
	"context"
	"database/sql"
	"path/filepath"
	"slices"
	"testing"
	"testing/fstest"

	_ "modernc.org/sqlite"

	"github.com/idemkit/idem/internal/sqldialect"
)

func TestStatements(t *testing.T) {
	for _, tc := range []struct {
		name, script string
		want         []string
	}{
		{"empty", "\n  \n-- only a comment;\n", nil},
		{"one per line", "CREATE TABLE a (x int);\nCREATE TABLE b (y int);\n", []string{"CREATE TABLE a (x int)", "CREATE TABLE b (y int)"}},
		{"over several lines", "-- head\n\nCREATE TABLE a (\n  x int\n);\n", []string{"CREATE TABLE a (\n  x int\n)"}},
		{"comment inside ending with a semicolon", "CREATE TABLE a (\n  -- the key;\n  x int\n);\n", []string{"CREATE TABLE a (\n  x int\n)"}},
		{"semicolon inside a line", "INSERT INTO a VALUES (';');\nSELECT 1;", []string{"INSERT INTO a VALUES (';')", "SELECT 1"}},
		{"last without a semicolon", "SELECT 1;\nSELECT 2\n", []string{"SELECT 1", "SELECT 2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Statements(tc.script); !slices.Equal(got, tc.want) {
				t.Fatalf("Statements(%q) = %q; want %q", tc.script, got, tc.want)
			}
		})
	}
}

type data struct{ T string }

func (d data) Table() string { return d.T }

func TestRender(t *testing.T) {
	fsys := fstest.MapFS{
		"m/sqlite/0002_b.sql": {Data: []byte("ALTER TABLE {{.Table}} ADD y int;\n")},
		"m/sqlite/0001_a.sql": {Data: []byte("CREATE TABLE {{.Table}} (x int);\n")},
		"m/sqlite/notes.txt":  {Data: []byte("not a migration")},
		"m/mysql/0001_a.sql":  {Data: []byte("other dialect;\n")},
	}
	ms, err := Render[Migration](fsys, "m/sqlite", data{T: `"t"`})
	if err != nil {
		t.Fatal(err)
	}
	want := []Migration{{"0001_a", "CREATE TABLE \"t\" (x int);\n"}, {"0002_b", "ALTER TABLE \"t\" ADD y int;\n"}}
	if !slices.Equal(ms, want) {
		t.Fatalf("Render = %q; want %q", ms, want)
	}
	bad := fstest.MapFS{"m/sqlite/0001_a.sql": {Data: []byte("{{.Nope}}")}}
	if _, err := Render[Migration](bad, "m/sqlite", data{}); err == nil {
		t.Fatal("Render of a template naming a missing field: no error")
	}
}

func openSQLite(t *testing.T) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+filepath.Join(t.TempDir(), "m.db")+"?_pragma=busy_timeout(10000)")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

func count(t *testing.T, db *sql.DB, query string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(query).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

// TestApplySQLite applies each version once: a migration inserting a row
// into a table without a unique constraint counts how often it ran.
func TestApplySQLite(t *testing.T) {
	ctx := context.Background()
	db := openSQLite(t)
	target := Target{Dialect: sqldialect.SQLite, VersionTable: `"m_migrations"`, LockName: "m"}

	applied, err := Applied(ctx, db, sqldialect.SQLite, "", "m_migrations", `"m_migrations"`)
	if err != nil || applied != nil {
		t.Fatalf("Applied before any Apply = %q, %v; want none", applied, err)
	}
	first := []Migration{
		{"0001_runs", "CREATE TABLE runs (version text);\n"},
		{"0002_mark", "-- a comment\nINSERT INTO runs VALUES ('0002');\n"},
	}
	for range 2 {
		if err := Apply(ctx, db, target, first); err != nil {
			t.Fatal(err)
		}
	}
	if n := count(t, db, "SELECT COUNT(*) FROM runs WHERE version = '0002'"); n != 1 {
		t.Fatalf("0002 ran %d times; want 1", n)
	}

	// A failing migration leaves nothing behind: neither its version nor
	// the migrations applied before it in the same call.
	failing := append(slices.Clone(first),
		Migration{"0003_mark", "INSERT INTO runs VALUES ('0003');\n"},
		Migration{"0004_broken", "INSERT INTO no_such_table VALUES (1);\n"},
	)
	if err := Apply(ctx, db, target, failing); err == nil {
		t.Fatal("Apply of a broken migration: no error")
	}
	if n := count(t, db, "SELECT COUNT(*) FROM runs WHERE version = '0003'"); n != 0 {
		t.Fatalf("0003 left %d rows after the call failed; want 0", n)
	}
	applied, err = Applied(ctx, db, sqldialect.SQLite, "", "m_migrations", `"m_migrations"`)
	if err != nil || !slices.Equal(applied, []string{"0001_runs", "0002_mark"}) {
		t.Fatalf("Applied = %q, %v; want 0001_runs 0002_mark", applied, err)
	}

	if err := Apply(ctx, db, target, failing[:3]); err != nil {
		t.Fatal(err)
	}
	if n := count(t, db, "SELECT COUNT(*) FROM runs"); n != 2 {
		t.Fatalf("runs has %d rows; want 2 (0002 and 0003 once each)", n)
	}
	applied, err = Applied(ctx, db, sqldialect.SQLite, "", "m_migrations", `"m_migrations"`)
	if err != nil || !slices.Equal(applied, []string{"0001_runs", "0002_mark", "0003_mark"}) {
		t.Fatalf("Applied = %q, %v; want 0001_runs 0002_mark 0003_mark", applied, err)
	}
}
