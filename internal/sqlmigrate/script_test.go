package sqlmigrate

import "testing"

func TestScript(t *testing.T) {
	type own struct {
		Version string
		SQL     string
	}
	ms := []own{{"0001_a", "CREATE TABLE a (x int);\n"}, {"0002_b", "CREATE INDEX b ON a (x);\n"}}
	want := "CREATE SCHEMA IF NOT EXISTS \"s\";\n\n" +
		"-- idem thing migration 0001_a\nCREATE TABLE a (x int);\n" +
		"\n-- idem thing migration 0002_b\nCREATE INDEX b ON a (x);\n"
	if got := Script("thing", `"s"`, ms); got != want {
		t.Errorf("Script with a schema =\n%s\nwant\n%s", got, want)
	}
	if got, want := Script("thing", "", ms[:1]), "-- idem thing migration 0001_a\nCREATE TABLE a (x int);\n"; got != want {
		t.Errorf("Script without a schema = %q, want %q", got, want)
	}
}
