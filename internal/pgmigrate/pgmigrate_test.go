package pgmigrate

import (
	"strings"
	"testing"
	"testing/fstest"
)

func TestRenderOrderAndTemplate(t *testing.T) {
	fsys := fstest.MapFS{
		"m/0002_b.sql": {Data: []byte("ALTER TABLE {{.}} ADD c int;\n")},
		"m/0001_a.sql": {Data: []byte("CREATE TABLE {{.}} (id int);\n")},
		"m/readme.txt": {Data: []byte("not a migration")},
	}
	ms, err := Render("test", fsys, "m", `"s"."t"`)
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) != 2 || ms[0].Version != "0001_a" || ms[1].Version != "0002_b" {
		t.Fatalf("migrations = %+v", ms)
	}
	if ms[0].SQL != "CREATE TABLE \"s\".\"t\" (id int);\n" {
		t.Fatalf("rendered SQL = %q", ms[0].SQL)
	}
	script := Script("test", "s", ms)
	if !strings.HasPrefix(script, `CREATE SCHEMA IF NOT EXISTS "s";`) || !strings.Contains(script, "-- idem test migration 0002_b") {
		t.Fatalf("script:\n%s", script)
	}
	if _, err := Render("test", fstest.MapFS{"m/0001.sql": {Data: []byte("{{.Missing}}")}}, "m", 1); err == nil ||
		!strings.Contains(err.Error(), "test: migration m/0001.sql") {
		t.Fatalf("a template error = %v, want it named", err)
	}
	if LockKey("a") == LockKey("b") {
		t.Fatal("lock keys of two names collide")
	}
}
