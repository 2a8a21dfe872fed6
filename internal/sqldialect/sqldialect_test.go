package sqldialect

import (
	"errors"
	"fmt"
	"testing"
)

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

// The shapes of the drivers' errors, declared here so that this package's
// tests import no driver; dedup/sqltable's tests classify the real
// errors of the real servers.
type pgError struct{ code string }

func (e *pgError) Error() string    { return "pg " + e.code }
func (e *pgError) SQLState() string { return e.code }

type MySQLError struct {
	Number   uint16
	SQLState [5]byte
	Message  string
}

func (e *MySQLError) Error() string { return e.Message }

type sqliteError struct{ code int }

func (e *sqliteError) Error() string { return "sqlite" }
func (e *sqliteError) Code() int     { return e.code }

func TestClassify(t *testing.T) {
	wrap := func(err error) error { return fmt.Errorf("exec: %w", err) }
	joined := func(err error) error { return errors.Join(errors.New("other"), err) }
	cases := []struct {
		d                 Dialect
		err               error
		unique, transient bool
	}{
		{Postgres, wrap(&pgError{"23505"}), true, false},
		{Postgres, &pgError{"40P01"}, false, true},
		{Postgres, joined(&pgError{"40001"}), false, true},
		{Postgres, &pgError{"55P03"}, false, true},
		{Postgres, &pgError{"42P01"}, false, false},
		{MySQL, wrap(&MySQLError{Number: 1062, SQLState: [5]byte{'2', '3', '0', '0', '0'}}), true, false},
		{MySQL, &MySQLError{Number: 1213}, false, true},
		{MySQL, joined(&MySQLError{Number: 1205}), false, true},
		{MySQL, &MySQLError{Number: 1146}, false, false},
		{SQLite, wrap(&sqliteError{1555}), true, false},
		{SQLite, &sqliteError{2067}, true, false},
		{SQLite, &sqliteError{5}, false, true},
		{SQLite, &sqliteError{517}, false, true}, // SQLITE_BUSY_SNAPSHOT
		{SQLite, &sqliteError{6}, false, true},
		{SQLite, &sqliteError{787}, false, false}, // SQLITE_CONSTRAINT_FOREIGNKEY
		{MySQL, &pgError{"23505"}, false, false},
		{Postgres, nil, false, false},
		{SQLite, errors.New("plain"), false, false},
	}
	for i, c := range cases {
		if got := c.d.UniqueViolation(c.err); got != c.unique {
			t.Errorf("%d: %v.UniqueViolation(%v) = %v", i, c.d, c.err, got)
		}
		if got := c.d.Transient(c.err); got != c.transient {
			t.Errorf("%d: %v.Transient(%v) = %v", i, c.d, c.err, got)
		}
	}
	if SQLState(&MySQLError{Number: 1062, SQLState: [5]byte{'2', '3', '0', '0', '0'}}) != "23000" {
		t.Error("SQLState of a MySQL error is wrong")
	}
	var nilErr *MySQLError
	if _, ok := MySQLNumber(nilErr); ok {
		t.Error("a nil *MySQLError has a number")
	}
}
