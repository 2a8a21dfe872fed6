package sqlname

import (
	"strings"
	"testing"
)

func TestCheck(t *testing.T) {
	for _, ok := range []string{"processed_events", "_x", "a1", "idem_outbox_v2"} {
		if err := Check("Table", ok); err != nil {
			t.Errorf("Check(%q) = %v", ok, err)
		}
	}
	for _, bad := range []string{"", "events; drop table x", "Events", "1abc", `a"b`, "a-b", "a.b", "ä", "a b",
		"x23456789012345678901234567890123456789012345678901234567890abcd"} {
		if err := Check("Table", bad); err == nil {
			t.Errorf("Check(%q) accepted", bad)
		}
	}
}

func FuzzCheckQuote(f *testing.F) {
	f.Add("processed_events")
	f.Add(`x"; drop table y; --`)
	f.Fuzz(func(t *testing.T, s string) {
		if Check("T", s) != nil {
			return
		}
		q := Quote(s)
		if q != `"`+s+`"` {
			t.Fatalf("an allowed name needed escaping: %q", s)
		}
	})
}

func TestSchemaTable(t *testing.T) {
	schema, table := "", ""
	if err := SchemaTable("x: Options", &schema, &table, "events", 50); err != nil || schema != "public" || table != "events" {
		t.Fatalf("defaults: %q %q %v", schema, table, err)
	}
	for _, c := range []struct{ schema, table, want string }{
		{"bad schema", "t", "x: Options.Schema"},
		{"s", "events; drop table x", "x: Options.Table"},
		{"s", "t234567890123456789012345678901234567890123456789012", "longer than 50 bytes"},
	} {
		s, tb := c.schema, c.table
		if err := SchemaTable("x: Options", &s, &tb, "events", 50); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q.%q: %v, want an error naming %q", c.schema, c.table, err, c.want)
		}
	}
}
