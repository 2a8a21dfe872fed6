// Package scenarios holds the double-payment scenarios as tests,
// against real PostgreSQL and Redis, and with the store on database/sql
// (dedup/sqltable) against PostgreSQL through database/sql, MariaDB and
// SQLite: a retry after a client timeout while the first attempt still runs, a double click (10 and 100 concurrent requests),
// a queue redelivery after a crash before the ACK, and a load-balancer retry
// that lands on a second instance with its own pool. Each counts charges in
// an oracle table without a unique constraint and ends with exactly one charge
// per payment and the same receipt for every caller that got one.
package scenarios
