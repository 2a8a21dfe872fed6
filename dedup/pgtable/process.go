package pgtable

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
)

// How Process runs (its doc says what it guarantees).
//
// The plain layout claims first:
//
//  1. BEGIN and the claim, a single INSERT ... ON CONFLICT DO NOTHING of the
//     key's row (completed, no result): one pgx batch (Batch.BeginTx), so
//     one round trip, of prepared statements. A concurrent claim of the same
//     key waits on the row's uniqueness check until the first transaction
//     ends. When the insert found a row (it inserted nothing), the claim
//     statement of ClaimTx runs in the same transaction with a new snapshot:
//     it takes over an expired row, or answers the verdict on a live one
//     (the transaction then rolls back and fn does not run);
//  2. fn's statements;
//  3. fn's result, when it is not nil (an UPDATE of the row), and COMMIT:
//     one batch, one round trip; a lone COMMIT is a simple query.
//
// A first delivery therefore costs the round trips of a bare business
// transaction (BEGIN, its statements, COMMIT) and one row insert beside its
// own.
//
// The partitioned layout has no unique index across partitions, so every
// writer of it takes the key's advisory lock, and Process writes the row
// once, at the end:
//
//  1. BEGIN, the key's lock, and a read of the key's row: one batch;
//  2. fn's statements;
//  3. the delete of the key's expired row (only when step 1 found one), the
//     INSERT of the key's row, completed and with fn's result, and COMMIT:
//     one batch.
//
// A duplicate waits in step 1 until the first transaction has ended. The
// read is a statement of its own, queued after the lock's, so it takes its
// snapshot after the lock was granted: under READ COMMITTED every statement
// takes a new snapshot (in a batch, at its Bind, which the server handles
// only after the previous statement finished; in the simple protocol, which
// a pgx connection configured for it uses for batches, each statement of
// the query string takes one too). PostgreSQL releases a transaction's locks
// only after its commit is visible to new snapshots, so the read sees the row
// the first transaction committed (or none, if it rolled back).
//
// A pool or a *pgx.Conn runs the steps as above (the fast path). Any other
// DB, such as a pgx.Tx (Process then runs in a savepoint), takes the bound
// path: Begin, then step 1's statements as one batch; at the end step 3's
// writes as one batch, then Commit.

// keyRow is the key's row as a read found it.
type keyRow struct {
	existing
	expired bool
}

// txRun is a transaction of Process that holds the key: its row is written
// (the plain layout) or its lock is held and no live row was found (the
// partitioned layout).
type txRun struct {
	tx pgx.Tx
	// conn is the connection of a fast-path transaction; nil on the bound
	// path.
	conn *pgx.Conn
	// claimed: step 1 wrote the key's row (the plain layout); step 3 only
	// adds the result.
	claimed bool
	// expired: step 1 of the partitioned layout found an expired row of
	// the key, which step 3 deletes before its insert.
	expired bool
	release func()
	// key is what the statements need of the key.
	key keyArgs
}

// rollback rolls tx back, bounded by 5s. It outlives ctx, so a cancelled
// caller does not leave a connection in a transaction.
func rollback(ctx context.Context, tx pgx.Tx) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	return tx.Rollback(rctx)
}

// begin is step 1. It returns the transaction, or the verdict on a live row
// of the key (an error wrapping a dedup sentinel), or an error.
func (s *Store) begin(ctx context.Context, key dedup.Key, a keyArgs) (*txRun, error) {
	switch db := s.db.(type) {
	case *pgxpool.Pool:
		pc, err := db.Acquire(ctx)
		if err != nil {
			return nil, fmt.Errorf("pgtable: acquire: %w", err)
		}
		r, err := s.fastBegin(ctx, pc.Conn(), key, a)
		if err != nil {
			pc.Release()
			return nil, err
		}
		r.release = pc.Release
		return r, nil
	case *pgx.Conn:
		r, err := s.fastBegin(ctx, db, key, a)
		if err != nil {
			return nil, err
		}
		r.release = func() {}
		return r, nil
	}
	return s.boundBegin(ctx, key, a)
}

func (s *Store) fastBegin(ctx context.Context, conn *pgx.Conn, key dedup.Key, a keyArgs) (*txRun, error) {
	b := pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, 0, 3)}
	b.BeginTx(pgx.TxOptions{})
	s.queueStep1(&b, key, a)
	br := conn.SendBatch(ctx, &b)
	tx := br.Tx()
	_, err := br.Exec() // BEGIN
	r, err := s.readStep1(ctx, br, tx, key, a, err)
	if err != nil {
		return nil, err
	}
	r.conn = conn
	return r, nil
}

// boundBegin is step 1 on the bound path.
func (s *Store) boundBegin(ctx context.Context, key dedup.Key, a keyArgs) (*txRun, error) {
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("pgtable: begin: %w", err)
	}
	b := pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, 0, 2)}
	s.queueStep1(&b, key, a)
	r, err := s.readStep1(ctx, tx.SendBatch(ctx, &b), tx, key, a, nil)
	if err != nil {
		return nil, err
	}
	r.release = func() {}
	return r, nil
}

// queueStep1 queues step 1's statements after BEGIN: the claim's insert
// (the plain layout), or the key's lock and then the read of its row, two
// statements so that the read's snapshot is taken once the lock is held
// (the partitioned layout).
func (s *Store) queueStep1(b *pgx.Batch, key dedup.Key, a keyArgs) {
	if s.opts.Partitioned {
		b.Queue(s.psql.lock, a.lock)
		b.Queue(s.sql.lookup, a.digest)
		return
	}
	b.Queue(s.sql.claimFirst, a.digest, key.Fingerprint.Bytes(), s.retentionArg, a.scope, a.id)
}

// readStep1 reads the results of queueStep1's statements from br (err is
// that of what br answered before them) and closes br. It returns the
// transaction when the caller may go on. Else it rolls tx back and returns
// the claim's error, or the verdict on the row found.
func (s *Store) readStep1(ctx context.Context, br pgx.BatchResults, tx pgx.Tx, key dedup.Key, a keyArgs, err error) (*txRun, error) {
	r := &txRun{tx: tx, key: a, claimed: !s.opts.Partitioned}
	var row *keyRow
	if err == nil {
		if r.claimed {
			var tag pgconn.CommandTag
			tag, err = br.Exec()
			if err == nil {
				err = br.Close()
			}
			if err == nil && tag.RowsAffected() == 0 {
				// The key has a row: take it over if it expired, else
				// answer the verdict on it (or an error naming the claim).
				if err := s.claimOnce(ctx, tx, s.sql.claimTx, key, a.digest, a.digest, key.Fingerprint.Bytes(), s.retentionArg, a.scope, a.id); err != nil {
					_ = rollback(ctx, tx)
					return nil, err
				}
			}
		} else {
			_, err = br.Exec() // the lock: waits for a concurrent Process
			if err == nil {
				row, err = scanKeyRow(br.QueryRow())
			}
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err == nil && (row == nil || row.expired) {
		r.expired = row != nil
		return r, nil
	}
	if err == nil {
		err = verdict(key, row.existing)
	} else {
		err = fmt.Errorf("pgtable: claim %s: %w", key, err)
	}
	// A closed tx (the batch failed before BEGIN) answers ErrTxClosed;
	// a failed rollback closes the connection.
	_ = rollback(ctx, tx)
	return nil, err
}

// abort rolls r's transaction back unless it has ended.
func (r *txRun) abort(ctx context.Context) {
	if r.conn != nil && (r.conn.IsClosed() || r.conn.PgConn().TxStatus() == 'I') {
		// Committed or rolled back by step 3 (whose COMMIT pgx's Tx does
		// not know about), or the connection is gone.
		return
	}
	_ = rollback(ctx, r.tx) // ErrTxClosed when the bound path committed
}

// queueWrite queues step 3's writes and returns how many it queued: the
// result of a row step 1 wrote (when there is one), or the delete of an
// expired row when step 1 found one and the insert of the row.
func (s *Store) queueWrite(b *pgx.Batch, r *txRun, key dedup.Key, result []byte) int {
	if r.claimed {
		if result == nil {
			return 0
		}
		b.Queue(s.sql.setResult, r.key.digest, result)
		return 1
	}
	n := 1
	if r.expired {
		b.Queue(s.psql.deleteExpired, r.key.digest)
		n++
	}
	b.Queue(s.psql.insertDone, r.key.digest, key.Fingerprint.Bytes(), s.retentionArg, result, r.key.scope, r.key.id)
	return n
}

// execWrites reads the results of queueWrite's n statements. The last one
// writes the key's row: it must change exactly one.
func execWrites(br pgx.BatchResults, n int) error {
	for i := range n {
		tag, err := br.Exec()
		if err != nil {
			return partitionHint(err)
		}
		if i == n-1 && tag.RowsAffected() != 1 {
			return fmt.Errorf("the write of the key's row changed %d rows, want 1", tag.RowsAffected())
		}
	}
	return nil
}

// finish is step 3: it writes fn's result (and, in the partitioned layout,
// the key's row) and commits.
func (s *Store) finish(ctx context.Context, r *txRun, key dedup.Key, result []byte) error {
	if r.conn == nil {
		return s.boundFinish(ctx, r, key, result)
	}
	if st := r.conn.PgConn().TxStatus(); st != 'T' {
		// A statement of fn failed and fn went on ('E'), or fn ended
		// the transaction itself ('I'): nothing of it can commit here.
		return fmt.Errorf("pgtable: commit %s: the transaction is not open (status %q): %w", key, st, pgx.ErrTxCommitRollback)
	}
	b := pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, 0, 3)}
	n := s.queueWrite(&b, r, key, result)
	var (
		tag        pgconn.CommandTag
		werr, cerr error
	)
	if n == 0 {
		// A lone COMMIT goes as a simple query, as pgx's own Commit
		// sends it: cheaper on both ends than a batch of one.
		tag, cerr = r.conn.Exec(ctx, "COMMIT")
	} else {
		b.Queue("COMMIT")
		br := r.conn.SendBatch(ctx, &b)
		werr = execWrites(br, n)
		if werr == nil {
			tag, cerr = br.Exec()
		}
		if err := br.Close(); cerr == nil && werr == nil {
			cerr = err
		}
	}
	switch {
	case werr != nil:
		return fmt.Errorf("pgtable: store %s: %w", key, werr)
	case cerr != nil:
		return fmt.Errorf("pgtable: commit %s: %w", key, cerr)
	case tag.String() != "COMMIT":
		return fmt.Errorf("pgtable: commit %s: the server answered %s: %w", key, tag, pgx.ErrTxCommitRollback)
	}
	return nil
}

func (s *Store) boundFinish(ctx context.Context, r *txRun, key dedup.Key, result []byte) error {
	var b pgx.Batch
	if n := s.queueWrite(&b, r, key, result); n > 0 {
		br := r.tx.SendBatch(ctx, &b)
		err := execWrites(br, n)
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("pgtable: store %s: %w", key, err)
		}
	}
	if err := r.tx.Commit(ctx); err != nil {
		return fmt.Errorf("pgtable: commit %s: %w", key, err)
	}
	return nil
}

func scanKeyRow(r pgx.Row) (*keyRow, error) {
	// One allocation for every scan target: Scan takes them as pointers
	// in an interface, so each would otherwise be one of its own.
	d := new(struct {
		row keyRow
		st  *int16
		ms  *int64
	})
	err := r.Scan(&d.st, &d.row.fp, &d.row.result, &d.ms, &d.row.expired)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	d.row.state, d.row.leaseMs = deref(d.st), deref(d.ms)
	return &d.row, nil
}
