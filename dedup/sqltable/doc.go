// Package sqltable is idem's dedup store on database/sql: the twin of
// dedup/pgtable for PostgreSQL, MySQL 8 / MariaDB 10.6+ and SQLite, with the
// claim inside the caller's *sql.Tx. It imports no driver: open the *sql.DB
// with the driver of your choice and name its dialect.
package sqltable
