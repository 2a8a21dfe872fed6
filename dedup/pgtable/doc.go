// Package pgtable is idem's PostgreSQL store, on pgx/v5. It keeps a
// processed_events table with one row per key, every time taken from the
// database clock. A row is keyed by the key's digest, a uuid holding the
// first 16 bytes of SHA-256(scope || 0x00 || id) (dedup.Key.Hash shows its
// first 8; see Options.TimeOrderedKeys for the key of a time-ordered id),
// and holds its expiry, the lease token of a key in flight, the
// fingerprint and the stored result (each NULL when absent), and the scope
// and id only with Options.KeepKeys. A claimed key without a result or a
// fingerprint takes 116 bytes with its index entries (TestRowSize).
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
// ClaimBatchTx claims many keys in one statement, inside the caller's
// transaction. BeginBatch is the cheaper form for a consumer that handles a
// batch in a transaction of its own (kafkapg's Batch and BatchAll): BEGIN
// and a plain INSERT of the batch's rows travel in one round trip, with no
// conflict clause and nothing sent back, and statements queued with
// BatchTx.AtCommit (a consumer's position) travel with COMMIT, so a batch
// of new keys costs the round trips of the bare business transaction and
// one row a key (with its entries in the primary key and the expires_at
// index). A key that already has a row fails that INSERT with a unique
// violation (after waiting for a concurrent transaction that holds the
// key); the batch is then claimed again, in a new transaction, with
// ClaimBatchTx's statements, which answer each key.
//
// With Options.TimeOrderedKeys, the row of an id that is a UUID of version
// 7 (what idem's outbox writes) or 6 is keyed by the id's time followed by
// the key's digest, so new rows land at the end of the primary key rather
// than on random pages: fewer pages written per claim, fewer full-page
// images in the WAL. It is set per table, when the table is new.
//
// Process wraps the whole shape and implements dedup.TxStore[pgx.Tx]:
//
//  1. BEGIN and the claim, a single INSERT ... ON CONFLICT DO NOTHING of the
//     key's row, in one round trip. A live row is answered at once
//     (duplicate with the stored result, in flight, fingerprint mismatch)
//     and fn does not run; an expired row is taken over.
//  2. fn runs in the transaction.
//  3. fn's result, when there is one, is stored on the row and the
//     transaction commits, in one round trip.
//
// A first message thus costs the round trips of the bare business
// transaction and one row insert beside its own. A concurrent claim of the
// same key, by Process, ClaimTx, ClaimBatchTx, BeginBatch or the lease mode, waits on
// the primary key until the first transaction ends, then sees its row (a
// duplicate replays its result), or claims the key if the first rolled
// back. When fn fails or panics, the transaction rolls back and nothing is
// written.
//
// A partitioned table (Options.Partitioned) has no unique index across its
// partitions: there Process, like every writer, takes a transaction-scoped
// advisory lock on the key (pg_advisory_xact_lock's single-bigint form, on
// the first 8 bytes of the key's digest XORed with a 64-bit hash of the
// schema and the table), reads the key's row, and inserts the row with
// fn's result at commit. A transaction-scoped lock suits PgBouncer's
// transaction pooling.
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
// golang-migrate users. A table made by an earlier version of idem, keyed by
// (scope, id), is converted in place by the migration 0002_key_digest
// (0003_key_digest when partitioned): its marks and leases carry over, and
// the table is rewritten once under an ACCESS EXCLUSIVE lock. Stop the
// processes of the earlier version first: they cannot write the new layout.
//
// Rows carry expires_at (Options.Retention after completion). A row must
// outlive every redelivery of its message: broker retention, relay retry
// horizon. Cleanup deletes expired rows in bounded batches and CleanupLoop runs
// it until its context ends. Each batch (Options.CleanupBatch rows) takes the
// rows that expired before the call began in expires_at order, a range scan
// of the expires_at index, and skips rows a claim holds locked: claims never
// wait for it.
//
// With Options.Partitioned the table is partitioned by expires_at in ranges
// of Options.PartitionWidth (a day by default; down to an hour for high
// volumes), so a row outlives its retention by at most one width. Cleanup
// detaches the partitions whose range has passed with ALTER TABLE ... DETACH
// PARTITION ... CONCURRENTLY and drops them, and EnsurePartitions creates the
// partitions ahead as plain tables attached with ATTACH PARTITION: neither
// takes a lock that claims wait for. Both run under
// Options.PartitionLockTimeout; a detach that runs out of it, behind a
// transaction still reading the partition, is finished by a later Cleanup
// (DETACH PARTITION ... FINALIZE). The table has no default partition
// (PostgreSQL does not detach concurrently beside one), so a claim whose
// expiry no partition covers fails: run CleanupLoop, or EnsurePartitions on
// a schedule. The partitioned layout needs PostgreSQL 14 or later.
//
// # Reading a key
//
// Lookup answers for a key as a claim would, without claiming it (for a
// cache in front of the store). Inspect, and InspectDigest by the key
// column when only the digest is known, read a key's row for an operator
// ("idem dedup show"): its dedup.KeyState, with the row's state, expiry,
// fingerprint, result and, with Options.KeepKeys, scope and id. Each is
// one read of the primary key.
//
// # Connections
//
// New takes a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx. With a pool, Process and
// the lease mode run concurrently. A *pgx.Conn is not safe for concurrent use,
// so neither is a store on one. With a pgx.Tx, Process runs in a savepoint of
// that transaction (steps 1 and 3 take up to two round trips each then) and
// lease operations commit only with it; the key stays held until that
// transaction ends. Statements go through pgx, so the connection's
// DefaultQueryExecMode applies (prepared statements by default).
//
// Through PgBouncer in transaction mode every path works but one: claims
// (Process, ClaimTx, ClaimBatchTx), the lease mode, Migrate, Cleanup of a
// plain table and EnsurePartitions hold nothing across transactions. Give
// the pool an exec mode that prepares no named statement
// (default_query_exec_mode=cache_describe, exec or simple_protocol), or
// run PgBouncer 1.21 or later with max_prepared_statements set. Cleanup of
// a partitioned table needs a session of its own (see Cleanup) and returns
// an error through a pooler: run it on a Store on a direct pool.
package pgtable
