// Package sqltable is idem's dedup store on database/sql: the twin of
// dedup/pgtable, with the claim inside the caller's *sql.Tx, for
// PostgreSQL, MySQL 8 / MariaDB 10.6 and later, and SQLite. It imports no
// driver: open the *sql.DB with the driver of your choice and name its
// dialect.
//
//	db, _ := sql.Open("mysql", "app@tcp(db:3306)/app")
//	store, err := sqltable.New(db, sqltable.MySQL, sqltable.Options{})
//	...
//	err = store.Migrate(ctx) // once, at deploy (or apply store.SQL())
//	result, err := store.Process(ctx, key, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
//		// the business writes, in tx
//	})
//
// The drivers it is tested with: pgx's stdlib driver and lib/pq
// (Postgres), go-sql-driver/mysql on MariaDB (MySQL), modernc.org/sqlite
// (SQLite, 3.35 or later).
//
// # The claim
//
// Process begins a transaction, claims the key in it, runs fn, stores fn's
// result and commits; ClaimTx claims a key in a transaction the caller
// began (consumers, HTTP), ClaimBatchTx many keys. A claim is the INSERT of
// the key's row (completed, no result); the row commits or rolls back with
// the business writes. A concurrent claim of the same key waits on the
// table's primary key until the first transaction ends, then answers a
// duplicate (dedup.ErrDuplicate with the first's stored result, see
// dedup.StoredResult) or, if the first rolled back, wins. A key seen with
// other content answers dedup.ErrFingerprintMismatch. A row past its
// retention, or a lease that ran out, counts as absent and is taken over.
//
// A deadlock, a lock wait the server gave up on, a serialization failure or
// a busy SQLite database is an error wrapping ErrTransient: it says nothing
// about the key (never a duplicate, never a dead letter); roll back and run
// the transaction again. The consumer middleware retries it like any store
// error.
//
// # Isolation levels
//
// PostgreSQL: READ COMMITTED, the server's default, is what the claim is
// built for. At REPEATABLE READ or SERIALIZABLE a claim that meets a row
// committed after its transaction's snapshot fails with a serialization
// failure (ErrTransient) instead of answering a duplicate.
//
// MySQL and MariaDB (InnoDB tables): READ COMMITTED, REPEATABLE READ (the
// default) and SERIALIZABLE. At each of them a duplicate's INSERT waits on
// the first transaction's row, and the read of the row that follows is a
// locking read, which sees the latest committed row whatever the
// transaction's snapshot. READ UNCOMMITTED is refused: the first Process,
// ClaimTx or lease Claim of a Store reads the session's level
// (transaction_isolation, or tx_isolation on MariaDB before 11.1) and
// answers ErrIsolation when it is not supported. A transaction the caller
// begins at another level than the session's (sql.TxOptions.Isolation) is
// the caller's to keep at a supported one. A duplicate waits at most
// innodb_lock_wait_timeout (50s by default), then answers ErrTransient.
// Two transactions that take over the same expired row at once may
// deadlock (both hold a shared lock on it): one of them answers
// ErrTransient.
//
// # SQLite: one writer
//
// SQLite lets one transaction write at a time, database-wide: a claim
// waits for every open write transaction, not only the one that holds its
// key. Give the DSN (modernc.org/sqlite spelling):
//
//   - _txlock=immediate, so that every transaction takes the write lock at
//     BEGIN (BEGIN IMMEDIATE). A transaction that reads before it writes
//     otherwise fails with SQLITE_BUSY when another writer committed in
//     between;
//   - _pragma=busy_timeout(N), the milliseconds a transaction waits for the
//     write lock before it fails with SQLITE_BUSY (ErrTransient); without
//     it, it fails at once;
//   - _pragma=journal_mode(WAL), so that readers do not wait for the
//     writer.
//
// For example "file:app.db?_txlock=immediate&_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)".
//
// # Lease mode
//
// Lease returns the lease mode, a dedup.LeaseStore on the same table for
// effects outside the database: Claim inserts the key's row with a token
// and an expiry taken from the database clock; Extend, Complete and Release
// check the token in their WHERE clause, so a stale owner gets
// dedup.ErrLeaseLost. Every statement runs on its own (autocommit).
//
// # Retention
//
// A completed key is kept for Options.Retention (7 days by default), which
// must outlive every redelivery of a message. Cleanup (or CleanupLoop, in a
// goroutine the caller owns) deletes expired rows in batches of
// Options.CleanupBatch, in expires_at order through its index, skipping
// the rows a claim holds locked (PostgreSQL, MySQL); no claim waits for it
// on PostgreSQL and MySQL. On SQLite a batch holds the write lock while it
// runs.
//
// # Schema
//
// Migrate applies the embedded migrations of the store's dialect and records
// them in <table>_migrations; several processes may run it at once. SQL
// prints them for goose, golang-migrate or by hand, and `idem migrate
// --driver` applies them. The table holds, per key, the first 16 bytes of
// SHA-256(scope || 0x00 || id), the expiry, the fingerprint, the lease
// token, the stored result, and with Options.KeepKeys the key's scope and
// id.
//
// # Reading a key
//
// Lookup answers for a key as a claim would, without claiming it. Inspect,
// and InspectDigest by the digest column when only the digest is known,
// read a key's row for an operator ("idem dedup show"): its
// dedup.KeyState. Each is one read of the primary key, without a lock.
//
// # A store that is down
//
// A claim on a database that cannot be reached returns the driver's error,
// never a claim and never a duplicate: callers fail closed.
package sqltable
