package sqldialect

import (
	"errors"
	"reflect"
)

// The error classes the database/sql packages act on. A driver's error is
// read through what it exposes, without importing the driver:
//
//   - PostgreSQL (pgx's stdlib driver, lib/pq): a SQLState() string method;
//   - MySQL and MariaDB (go-sql-driver/mysql): a *MySQLError whose fields
//     Number (the server's error number) and SQLState are read by
//     reflection, since it has no methods that say them;
//   - SQLite (modernc.org/sqlite): a Code() int method, the extended
//     result code.

// sqlStater is the error of pgx's stdlib driver (*pgconn.PgError) and of
// lib/pq (*pq.Error).
type sqlStater interface{ SQLState() string }

// sqliteCoder is the error of modernc.org/sqlite (*sqlite.Error).
type sqliteCoder interface{ Code() int }

// walk calls f on err and every error it wraps, depth first, until f
// returns true.
func walk(err error, f func(error) bool) bool {
	for err != nil {
		if f(err) {
			return true
		}
		switch u := err.(type) { //nolint:errorlint // walking the chain by hand
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				if walk(e, f) {
					return true
				}
			}
			return false
		case interface{ Unwrap() error }:
			err = u.Unwrap()
		default:
			return false
		}
	}
	return false
}

// SQLState returns the SQLSTATE code err carries (PostgreSQL's, or the
// one MySQL sends with an error number), or "" when it carries none.
func SQLState(err error) string {
	var state string
	walk(err, func(e error) bool {
		if s, ok := e.(sqlStater); ok { // walk unwraps
			state = s.SQLState()
			return true
		}
		if _, st, ok := mysqlFields(e); ok {
			state = st
			return true
		}
		return false
	})
	return state
}

// MySQLNumber returns the MySQL or MariaDB error number err carries (1062
// for a duplicate key, 1213 for a deadlock, ...), and whether it carries
// one.
func MySQLNumber(err error) (int, bool) {
	var n int
	found := walk(err, func(e error) bool {
		num, _, ok := mysqlFields(e)
		n = num
		return ok
	})
	return n, found
}

// mysqlFields reads Number and SQLState of a go-sql-driver/mysql
// *MySQLError (a struct named MySQLError with a uint16 Number field).
func mysqlFields(err error) (int, string, bool) {
	v := reflect.ValueOf(err)
	if v.Kind() == reflect.Pointer {
		if v.IsNil() {
			return 0, "", false
		}
		v = v.Elem()
	}
	if v.Kind() != reflect.Struct || v.Type().Name() != "MySQLError" {
		return 0, "", false
	}
	num := v.FieldByName("Number")
	if !num.IsValid() || num.Kind() != reflect.Uint16 {
		return 0, "", false
	}
	state := ""
	if st := v.FieldByName("SQLState"); st.IsValid() && st.Kind() == reflect.Array && st.Type().Elem().Kind() == reflect.Uint8 {
		b := make([]byte, st.Len())
		for i := range b {
			b[i] = byte(st.Index(i).Uint())
		}
		state = string(b)
	}
	return int(num.Uint()), state, true
}

// SQLiteCode returns the SQLite extended result code err carries, and
// whether it carries one. The primary code is its low byte.
func SQLiteCode(err error) (int, bool) {
	var c sqliteCoder
	if errors.As(err, &c) {
		return c.Code(), true
	}
	return 0, false
}

// MySQL and MariaDB error numbers.
const (
	mysqlDupEntry        = 1062 // ER_DUP_ENTRY
	mysqlLockWaitTimeout = 1205 // ER_LOCK_WAIT_TIMEOUT
	mysqlDeadlock        = 1213 // ER_LOCK_DEADLOCK
)

// SQLite primary result codes.
const (
	sqliteBusy       = 5  // SQLITE_BUSY
	sqliteLocked     = 6  // SQLITE_LOCKED
	sqliteConstraint = 19 // SQLITE_CONSTRAINT
)

// SQLite extended result codes of SQLITE_CONSTRAINT.
const (
	sqliteConstraintPrimaryKey = 1555 // SQLITE_CONSTRAINT_PRIMARYKEY
	sqliteConstraintUnique     = 2067 // SQLITE_CONSTRAINT_UNIQUE
)

// UniqueViolation reports whether err is the server refusing a row whose
// key is already taken: SQLSTATE 23505 on PostgreSQL, error 1062 on
// MySQL and MariaDB, SQLITE_CONSTRAINT_PRIMARYKEY or _UNIQUE on SQLite.
func (d Dialect) UniqueViolation(err error) bool {
	if err == nil {
		return false
	}
	switch d {
	case Postgres:
		return SQLState(err) == "23505"
	case MySQL:
		n, ok := MySQLNumber(err)
		return ok && n == mysqlDupEntry
	case SQLite:
		c, ok := SQLiteCode(err)
		return ok && (c == sqliteConstraintPrimaryKey || c == sqliteConstraintUnique)
	}
	return false
}

// Transient reports whether err is the server giving up on a statement
// that a new attempt of the whole transaction can pass: a deadlock, a
// lock wait that timed out or a serialization failure (SQLSTATE 40001,
// 40P01 and 55P03 on PostgreSQL; errors 1213 and 1205 on MySQL and
// MariaDB), or a locked database (SQLITE_BUSY, SQLITE_LOCKED). Such an
// error says nothing about the key: it is never a duplicate.
func (d Dialect) Transient(err error) bool {
	if err == nil {
		return false
	}
	switch d {
	case Postgres:
		switch SQLState(err) {
		case "40001", "40P01", "55P03":
			return true
		}
	case MySQL:
		n, ok := MySQLNumber(err)
		return ok && (n == mysqlDeadlock || n == mysqlLockWaitTimeout)
	case SQLite:
		c, ok := SQLiteCode(err)
		return ok && (c&0xff == sqliteBusy || c&0xff == sqliteLocked)
	}
	return false
}
