package pgtable

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/pgtx"
)

// BatchTx is a transaction that BeginBatch opened and claimed a batch of
// keys in. The caller's statements run through Tx; Commit sends the
// statements queued with AtCommit and COMMIT together, and Rollback undoes
// everything, claims included. Either one returns the connection to its
// pool. A BatchTx is not safe for concurrent use.
type BatchTx struct{ t *pgtx.Tx }

// Tx returns the transaction, for the statements that commit with the
// claims. Do not end it (Commit, Rollback) through Tx: end the BatchTx.
func (b *BatchTx) Tx() pgx.Tx { return b.t.Tx() }

// AtCommit queues a statement to send with COMMIT, in the same round trip
// on a pool or a *pgx.Conn. The statements queued run in order, before
// COMMIT; when one of them fails, nothing commits and Commit returns its
// error.
func (b *BatchTx) AtCommit(sql string, args ...any) { b.t.AtCommit(sql, args...) }

// Commit runs the statements queued with AtCommit and commits. It returns
// nil once everything committed. Else the transaction is rolled back and
// the error says why: a statement failed, or pgx.ErrTxCommitRollback when a
// statement run through Tx had failed before. The connection goes back to
// its pool either way, and Rollback after Commit does nothing.
func (b *BatchTx) Commit(ctx context.Context) error {
	if err := b.t.Commit(ctx); err != nil {
		return fmt.Errorf("pgtable: commit: %w", err)
	}
	return nil
}

// Rollback rolls the transaction back, claims included, and returns the
// connection to its pool. After Commit or Rollback it does nothing.
func (b *BatchTx) Rollback(ctx context.Context) error { return b.t.Rollback(ctx) }

// BeginBatch begins a transaction on db and claims keys in it, for a
// consumer that handles a batch of messages in one transaction. It returns
// the transaction and one error per key, in order: nil for a key this
// transaction claimed first, else what ClaimTx would return (a key repeated
// in keys is claimed by its first occurrence, and the later ones get
// dedup.ErrDuplicate or dedup.ErrFingerprintMismatch). The claims commit or
// roll back with the transaction. When the error is not nil, no
// transaction is open and no key was claimed.
//
// In the plain layout the claim is a plain INSERT of the keys' rows, in the
// order of their row keys: no conflict clause, nothing sent back, one row
// a key with its index entries, and on a *pgxpool.Pool or a *pgx.Conn it
// travels with BEGIN, in one round trip. A key that has a row (a
// duplicate, a row past its retention, a lease-mode claim) fails that
// INSERT with a unique violation, after waiting for a concurrent
// transaction that inserted the key to end; BeginBatch then rolls the
// transaction back and claims the batch in a new one with ClaimBatchTx,
// which answers each key's verdict (and takes over expired rows). A batch
// of new keys thus costs its rows and no round trip of its own; a batch
// with a key claimed before costs one transaction more.
//
// On a pgx.Tx the batch runs in a savepoint of it (BEGIN and the INSERT
// take a round trip each). In the partitioned layout BeginBatch begins the
// transaction and runs ClaimBatchTx in it.
func (s *Store) BeginBatch(ctx context.Context, db DB, keys []dedup.Key) (*BatchTx, []error, error) {
	if isNil(db) {
		return nil, nil, errors.New("pgtable: BeginBatch: db is nil: pass a *pgxpool.Pool, *pgx.Conn or pgx.Tx")
	}
	if !s.opts.Partitioned {
		t, out, err := s.beginPlain(ctx, db, keys)
		if err == nil {
			return &BatchTx{t}, out, nil
		}
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != uniqueViolation {
			return nil, nil, fmt.Errorf("pgtable: batch claim: %w", err)
		}
		s.batchConflicts.Add(1)
	}
	t, err := pgtx.Begin(ctx, db, nil, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("pgtable: %w", err)
	}
	out, err := s.ClaimBatchTx(ctx, t.Tx(), keys)
	if err != nil {
		_ = t.Rollback(ctx)
		return nil, nil, err
	}
	return &BatchTx{t}, out, nil
}

// beginPlain begins the transaction with the plain INSERT of keys' rows
// (claimBatchPlain). It returns the verdicts of a transaction that claimed
// every valid key, or the error of BEGIN or of the INSERT (a unique
// violation when a key had a row), with no transaction open.
func (s *Store) beginPlain(ctx context.Context, db DB, keys []dedup.Key) (*pgtx.Tx, []error, error) {
	out := make([]error, len(keys))
	var b claimBatch
	pos := make([]int, 0, len(keys)) // index in b -> index in keys
	for i, k := range keys {
		if err := s.validate(k); err != nil {
			out[i] = err
			continue
		}
		b.add(s.keyArgs(k), k.Fingerprint.Bytes())
		pos = append(pos, i)
	}
	sorted, first := b.sorted()
	// A key repeated in the batch: its first occurrence claims it.
	for j, d := range b.digests {
		if f := first[d.Bytes]; f != j {
			out[pos[j]] = repeatVerdict(keys[pos[j]], keys[pos[f]])
		}
	}
	var queue func(*pgx.Batch)
	var read func(pgx.BatchResults) error
	if len(sorted.digests) > 0 {
		queue = func(pb *pgx.Batch) {
			pb.Queue(s.sql.claimBatchPlain, sorted.digests, sorted.fps, s.retentionArg, sorted.scopes, sorted.ids)
		}
		read = func(br pgx.BatchResults) error {
			_, err := br.Exec()
			return err
		}
	}
	t, err := pgtx.Begin(ctx, db, queue, read)
	if err != nil {
		return nil, nil, err
	}
	return t, out, nil
}

// uniqueViolation is the SQLSTATE of a unique violation.
const uniqueViolation = "23505"

// repeatVerdict is the answer to a key repeated in a batch after its first
// occurrence, first: a duplicate of it, or a fingerprint mismatch.
func repeatVerdict(k, first dedup.Key) error {
	if !k.Fingerprint.Matches(first.Fingerprint) {
		return &dedup.ClaimError{Err: dedup.ErrFingerprintMismatch, Key: k}
	}
	return &dedup.ClaimError{Err: dedup.ErrDuplicate, Key: k}
}
