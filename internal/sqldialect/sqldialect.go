// Package sqldialect holds what idem's database/sql packages need to know
// about the SQL server behind a *sql.DB: how it writes placeholders and
// which server it is. The stores and the outbox on database/sql export its
// Dialect values under their own names, so a user writes sqltable.MySQL or
// sqloutbox.MySQL; this package imports no driver.
package sqldialect

import (
	"strconv"
	"strings"
)

// Dialect is one SQL server family reached through database/sql.
type Dialect int

// The dialects idem supports on database/sql. The zero value is no
// dialect: constructors refuse it.
const (
	// Postgres is PostgreSQL through database/sql (pgx's stdlib driver or
	// lib/pq).
	Postgres Dialect = iota + 1
	// MySQL is MySQL 8 or MariaDB 10.6 and later (go-sql-driver/mysql).
	MySQL
	// SQLite is SQLite 3 (modernc.org/sqlite, or any other driver).
	SQLite
)

// String returns the dialect's name: postgres, mysql or sqlite.
func (d Dialect) String() string {
	switch d {
	case Postgres:
		return "postgres"
	case MySQL:
		return "mysql"
	case SQLite:
		return "sqlite"
	}
	return "dialect(" + strconv.Itoa(int(d)) + ")"
}

// Valid reports whether d is one of the supported dialects.
func (d Dialect) Valid() bool { return d >= Postgres && d <= SQLite }

// Rebind rewrites a statement written with ? placeholders into the
// dialect's own: $1, $2, ... on PostgreSQL, unchanged on MySQL and SQLite.
// A ? inside a quoted string or identifier is left alone.
func (d Dialect) Rebind(query string) string {
	if d != Postgres || !strings.Contains(query, "?") {
		return query
	}
	var b strings.Builder
	b.Grow(len(query) + 8)
	n := 0
	var quote byte
	for i := 0; i < len(query); i++ {
		c := query[i]
		switch {
		case quote != 0:
			if c == quote {
				quote = 0
			}
		case c == '\'' || c == '"' || c == '`':
			quote = c
		case c == '?':
			n++
			b.WriteByte('$')
			b.WriteString(strconv.Itoa(n))
			continue
		}
		b.WriteByte(c)
	}
	return b.String()
}

// Quote returns name as a quoted identifier in the dialect (backquotes on
// MySQL, double quotes elsewhere). The name must have been checked against
// the allow-list of internal/sqlname first.
func (d Dialect) Quote(name string) string {
	if d == MySQL {
		return "`" + strings.ReplaceAll(name, "`", "``") + "`"
	}
	return `"` + strings.ReplaceAll(name, `"`, `""`) + `"`
}
