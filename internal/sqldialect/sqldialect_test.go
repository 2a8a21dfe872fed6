package sqldialect

import "testing"

func TestRebind(t *testing.T) {
	cases := []struct {
		d    Dialect
		in   string
		want string
	}{
		{Postgres, "SELECT a FROM t WHERE k = ? AND s = ?", "SELECT a FROM t WHERE k = $1 AND s = $2"},
		{Postgres, "SELECT '?' FROM t WHERE k = ?", "SELECT '?' FROM t WHERE k = $1"},
		{Postgres, `SELECT "a?" FROM t WHERE k = ?`, `SELECT "a?" FROM t WHERE k = $1`},
		{MySQL, "SELECT a FROM t WHERE k = ?", "SELECT a FROM t WHERE k = ?"},
		{SQLite, "SELECT a FROM t WHERE k = ?", "SELECT a FROM t WHERE k = ?"},
	}
	for _, c := range cases {
		if got := c.d.Rebind(c.in); got != c.want {
			t.Errorf("%v.Rebind(%q) = %q, want %q", c.d, c.in, got, c.want)
		}
	}
}

func TestQuoteAndString(t *testing.T) {
	if got := MySQL.Quote("events"); got != "`events`" {
		t.Errorf("MySQL.Quote = %s", got)
	}
	if got := Postgres.Quote("events"); got != `"events"` {
		t.Errorf("Postgres.Quote = %s", got)
	}
	if Dialect(0).Valid() || !SQLite.Valid() || Dialect(9).Valid() {
		t.Error("Valid is wrong")
	}
	if SQLite.String() != "sqlite" || Dialect(0).String() != "dialect(0)" {
		t.Error("String is wrong")
	}
}
