// Package pgtable is idem's PostgreSQL store, on pgx/v5. It keeps a
// processed_events table keyed by (scope, id), with the fingerprint, the
// stored result and timestamps, and every time taken from the database clock.
//
// # Transactional mode
//
// ClaimTx inserts the key's row inside the caller's pgx.Tx, in the same
// transaction as the business writes (and the outbox rows): both commit or
// neither does. It answers "first", ErrDuplicate or ErrFingerprintMismatch in
// one round trip. A concurrent duplicate blocks on the primary key until the
// first transaction ends, then sees a duplicate, or proceeds if the first
// rolled back. There is no lease and no clock involved: the effect on the
// database happens once for as long as the row is kept.
//
// Process wraps the whole shape (begin, claim, run, store the result, commit)
// and implements dedup.TxStore[pgx.Tx]; ClaimBatchTx claims many keys in one
// statement for consumers that handle a batch in one transaction.
//
// # Lease mode
//
// Store.Lease returns a dedup.LeaseStore on the same table for effects outside
// the database, with the semantics of dedup/redisnx: a claim with a random
// token and a lease expiry from the database clock, Extend, Complete and
// Release compared on the token, and dedup.ErrLeaseLost for a stale owner.
//
// # Schema, migrations and retention
//
// Schema and table names are options, checked against an allow-list and
// quoted. Migrate applies the embedded SQL under an advisory lock, so several
// processes may run it at once; SQL prints the same SQL for goose or
// golang-migrate users.
//
// Rows carry expires_at (Options.Retention after completion). A row must
// outlive every redelivery of its message: broker retention, relay retry
// horizon. Cleanup deletes expired rows in bounded batches and CleanupLoop runs
// it until its context ends.
//
// # Connections
//
// New takes a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx. With a pool, Process and
// the lease mode run concurrently. A *pgx.Conn is not safe for concurrent use,
// so neither is a store on one. With a pgx.Tx, Process runs in a savepoint of
// that transaction and lease operations commit only with it.
package pgtable
