package pgtable

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
)

// How Process runs (its doc says what it guarantees). The key's row is
// written once, at the end:
//
//  1. BEGIN, the key's lock, and a read of the key's row: one pgx batch
//     (Batch.BeginTx), so one round trip, of prepared statements;
//  2. fn's statements;
//  3. the delete of the key's expired row (only when step 1 found one), the
//     INSERT of the key's row, completed and with fn's result, and COMMIT:
//     one batch, one round trip.
//
// A first request therefore costs the round trips of a bare business
// transaction (BEGIN, its statements, COMMIT) and one row write beside its
// own, plus a lock and an index probe.
//
// The lock serializes Process calls of one key: a duplicate waits in step 1
// until the first transaction has ended. The read is a statement of its own,
// queued after the lock's, so it takes its snapshot after the lock was
// granted: under READ COMMITTED every statement takes a new snapshot (in a
// batch, at its Bind, which the server handles only after the previous
// statement finished; in the simple protocol, which a pgx connection
// configured for it uses for batches, each statement of the query string
// takes one too). PostgreSQL releases a transaction's locks only after its
// commit is visible to new snapshots, so the read sees the row the first
// transaction committed (or none, if it rolled back).
//
// Writers that do not take the lock (ClaimTx and ClaimBatchTx in a
// transaction of their own, the lease mode) may write the key between steps
// 1 and 3. Step 3's INSERT then fails on the primary key (unique_violation;
// a failed statement keeps the COMMIT queued after it from running), the
// transaction rolls back with fn's writes, and Process reads the row that
// won and returns the verdict on it. In the partitioned layout every writer
// takes the lock, so step 3 cannot meet a live row there.
//
// A pool or a *pgx.Conn runs the steps as above (the fast path). Any other
// DB, such as a pgx.Tx (Process then runs in a savepoint), takes the bound
// path: Begin, then the lock and the read as one batch; at the end the
// delete and the insert as one batch, then Commit.

const uniqueViolation = "23505"

// keyRow is the key's row as a read found it.
type keyRow struct {
	existing
	expired bool
}

// txRun is a transaction of Process that holds the key's lock and found no
// live row of the key.
type txRun struct {
	tx pgx.Tx
	// conn is the connection of a fast-path transaction; nil on the bound
	// path.
	conn *pgx.Conn
	// expired: step 1 found an expired row of the key, which step 3
	// deletes before its insert.
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

// lostRace ends r, whose insert of the key's row lost to a writer that
// does not take the key's lock: it rolls back, then reads the winner's
// row through q and returns the verdict on it.
func (s *Store) lostRace(ctx context.Context, r *txRun, key dedup.Key, q querier) error {
	if err := rollback(ctx, r.tx); err != nil {
		return fmt.Errorf("pgtable: commit %s: roll back: %w", key, err)
	}
	return s.settleLost(ctx, q, key, r.key.digest)
}

func (s *Store) lockSQL() string {
	if s.opts.Partitioned {
		return s.psql.lock
	}
	return s.sql.lock
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
	s.queueLockAndRead(&b, a)
	br := conn.SendBatch(ctx, &b)
	tx := br.Tx()
	_, err := br.Exec() // BEGIN
	row, err := readLockAndRow(ctx, br, tx, key, err)
	if err != nil {
		return nil, err
	}
	return &txRun{tx: tx, conn: conn, expired: row != nil, key: a}, nil
}

// boundBegin is step 1 on the bound path.
func (s *Store) boundBegin(ctx context.Context, key dedup.Key, a keyArgs) (*txRun, error) {
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("pgtable: begin: %w", err)
	}
	b := pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, 0, 2)}
	s.queueLockAndRead(&b, a)
	row, err := readLockAndRow(ctx, tx.SendBatch(ctx, &b), tx, key, nil)
	if err != nil {
		return nil, err
	}
	return &txRun{tx: tx, expired: row != nil, release: func() {}, key: a}, nil
}

// queueLockAndRead queues the key's advisory lock, then the read of its
// row: two statements, so that the read's snapshot is taken once the lock
// is held.
func (s *Store) queueLockAndRead(b *pgx.Batch, a keyArgs) {
	b.Queue(s.lockSQL(), a.lock)
	b.Queue(s.sql.lookup, a.digest)
}

// readLockAndRow reads the results of queueLockAndRead's statements from br
// (err is that of what br answered before them) and closes br. It returns
// the key's row when the caller may go on: none, or an expired one. Else
// it rolls tx back and returns the claim's error, or the verdict on the
// row found.
func readLockAndRow(ctx context.Context, br pgx.BatchResults, tx pgx.Tx, key dedup.Key, err error) (*keyRow, error) {
	if err == nil {
		_, err = br.Exec() // the lock: waits for a concurrent Process
	}
	var row *keyRow
	if err == nil {
		row, err = scanKeyRow(br.QueryRow())
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err == nil && (row == nil || row.expired) {
		return row, nil
	}
	if err != nil {
		err = fmt.Errorf("pgtable: claim %s: %w", key, err)
	} else {
		err = verdict(key, row.existing)
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

// queueWrite queues step 3's writes: the delete of an expired row when step
// 1 found one, and the insert.
func (s *Store) queueWrite(b *pgx.Batch, r *txRun, key dedup.Key, result []byte) {
	del, ins := s.sql.deleteExpired, s.sql.insertDone
	if s.opts.Partitioned {
		del, ins = s.psql.deleteExpired, s.psql.insertDone
	}
	if r.expired {
		b.Queue(del, r.key.digest)
	}
	b.Queue(ins, r.key.digest, key.Fingerprint.Bytes(), s.retentionArg, result, r.key.scope, r.key.id)
}

// execWrites reads the results of queueWrite's statements.
func execWrites(br pgx.BatchResults, r *txRun) error {
	if r.expired {
		if _, err := br.Exec(); err != nil {
			return err
		}
	}
	_, err := br.Exec()
	return partitionHint(err)
}

func isUniqueViolation(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == uniqueViolation
}

// finish is step 3: it writes the key's row, completed with result, and
// commits. When a writer that does not take the key's lock got the key
// first, the transaction is rolled back and the error is the verdict on that
// writer's row (see lost).
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
	s.queueWrite(&b, r, key, result)
	b.Queue("COMMIT")
	br := r.conn.SendBatch(ctx, &b)
	werr := execWrites(br, r)
	var (
		tag  pgconn.CommandTag
		cerr error
	)
	if werr == nil {
		tag, cerr = br.Exec()
	}
	if err := br.Close(); cerr == nil && werr == nil {
		cerr = err
	}
	switch {
	case isUniqueViolation(werr):
		// The insert lost; the COMMIT behind it did not run.
		return s.lostRace(ctx, r, key, r.conn)
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
	s.queueWrite(&b, r, key, result)
	br := r.tx.SendBatch(ctx, &b)
	err := execWrites(br, r)
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if isUniqueViolation(err) {
		return s.lostRace(ctx, r, key, s.db)
	}
	if err != nil {
		return fmt.Errorf("pgtable: store %s: %w", key, err)
	}
	if err := r.tx.Commit(ctx); err != nil {
		return fmt.Errorf("pgtable: commit %s: %w", key, err)
	}
	return nil
}

// ErrLostRace is wrapped by the error of Process when fn ran but its
// transaction rolled back because a writer that does not take the key's lock
// (ClaimTx in a transaction of its own, the lease mode) wrote the key meanwhile, and that
// row was gone or expired again when Process read it. Nothing was committed:
// a retry runs fn again.
var ErrLostRace = errors.New("pgtable: the key was written concurrently by a claim that does not take its lock; nothing was committed, retry")

// settleLost reads the key's row after step 3 lost, with a new statement (so
// a new snapshot), and returns the verdict on it, or ErrLostRace when there
// is no live row any more.
func (s *Store) settleLost(ctx context.Context, q querier, key dedup.Key, digest pgtype.UUID) error {
	row, err := scanKeyRow(q.QueryRow(ctx, s.sql.lookup, digest))
	if err != nil {
		return fmt.Errorf("pgtable: read %s: %w", key, err)
	}
	if row == nil || row.expired {
		return fmt.Errorf("pgtable: commit %s: %w", key, ErrLostRace)
	}
	return verdict(key, row.existing)
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
