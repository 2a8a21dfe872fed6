// Package pgtx is the pgx transaction of idem's batch paths (pgtable's
// BeginBatch, kafkapg's OffsetsOnly): begun with statements of its own in
// the round trip of BEGIN, and committed with statements queued to go in
// the round trip of COMMIT, so that a batch costs the round trips of a bare
// business transaction (BEGIN, the caller's statements, COMMIT).
package pgtx

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DB is what a transaction begins on: a *pgxpool.Pool or a *pgx.Conn (the
// fast path, whose statements travel with BEGIN and COMMIT), or any other
// DB such as a pgx.Tx (the bound path: db.Begin, then the statements, each
// group in a round trip of its own).
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Tx is an open transaction. It is not safe for concurrent use.
type Tx struct {
	tx pgx.Tx
	// conn is the connection of a fast-path transaction; nil on the bound
	// path.
	conn    *pgx.Conn
	release func()
	last    pgx.Batch // the statements queued with AtCommit
	ended   bool
}

// Begin begins a transaction on db with the statements queue adds (none
// when queue is nil); read reads their results from br, in order (BEGIN's
// is read already). On the fast path BEGIN and the statements travel in one
// round trip. When BEGIN, a statement or read fails, the transaction is
// rolled back, the connection goes back to its pool, and Begin returns the
// error (a failed BEGIN's wrapped as "begin: ...", the statements' as read
// returned them).
func Begin(ctx context.Context, db DB, queue func(b *pgx.Batch), read func(br pgx.BatchResults) error) (*Tx, error) {
	t := &Tx{release: func() {}}
	switch d := db.(type) {
	case *pgxpool.Pool:
		pc, err := d.Acquire(ctx)
		if err != nil {
			return nil, fmt.Errorf("acquire: %w", err)
		}
		t.conn, t.release = pc.Conn(), pc.Release
	case *pgx.Conn:
		t.conn = d
	}
	if err := t.begin(ctx, db, queue, read); err != nil {
		t.release()
		return nil, err
	}
	return t, nil
}

func (t *Tx) begin(ctx context.Context, db DB, queue func(*pgx.Batch), read func(pgx.BatchResults) error) error {
	var (
		b  pgx.Batch
		br pgx.BatchResults
	)
	if t.conn == nil {
		tx, err := db.Begin(ctx)
		if err != nil {
			return fmt.Errorf("begin: %w", err)
		}
		t.tx = tx
		if queue == nil {
			return nil
		}
		queue(&b)
		br = tx.SendBatch(ctx, &b)
	} else {
		b.BeginTx(pgx.TxOptions{})
		if queue != nil {
			queue(&b)
		}
		br = t.conn.SendBatch(ctx, &b)
		t.tx = br.Tx()
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			_ = Rollback(ctx, t.tx) // ErrTxClosed: the batch closed it
			return fmt.Errorf("begin: %w", err)
		}
	}
	var err error
	if read != nil {
		err = read(br)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = Rollback(ctx, t.tx)
		return err
	}
	return nil
}

// Rollback rolls tx back, bounded by 5s. It outlives ctx, so a cancelled
// caller does not leave a connection in a transaction.
func Rollback(ctx context.Context, tx pgx.Tx) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	return tx.Rollback(rctx)
}

// Tx returns the transaction, for the caller's statements. They must not
// end it (Commit, Rollback): end t.
func (t *Tx) Tx() pgx.Tx { return t.tx }

// AtCommit queues a statement to send with COMMIT, in its round trip on
// the fast path. The statements run in order, before COMMIT; when one of
// them fails, nothing commits and Commit returns its error.
func (t *Tx) AtCommit(sql string, args ...any) { t.last.Queue(sql, args...) }

// Commit runs the statements queued with AtCommit and commits. It returns
// nil once everything committed. Else the transaction is rolled back and
// the error says why: a statement failed, or pgx.ErrTxCommitRollback when a
// statement had failed before (the transaction was aborted). The
// connection goes back to its pool either way, and Rollback after Commit
// does nothing.
func (t *Tx) Commit(ctx context.Context) error {
	if t.ended {
		return pgx.ErrTxClosed
	}
	t.ended = true
	defer t.release()
	if t.conn == nil {
		return t.boundCommit(ctx)
	}
	if st := t.conn.PgConn().TxStatus(); st != 'T' {
		// A statement failed and the caller went on ('E'), or the
		// caller ended the transaction itself ('I').
		_ = Rollback(ctx, t.tx)
		return fmt.Errorf("the transaction is not open (status %q): %w", st, pgx.ErrTxCommitRollback)
	}
	n := t.last.Len()
	var (
		tag pgconn.CommandTag
		err error
	)
	if n == 0 {
		// A lone COMMIT goes as a simple query, as pgx's own Commit
		// sends it.
		tag, err = t.conn.Exec(ctx, "COMMIT")
	} else {
		t.last.Queue("COMMIT")
		br := t.conn.SendBatch(ctx, &t.last)
		for i := 0; i < n && err == nil; i++ {
			_, err = br.Exec()
		}
		if err == nil {
			tag, err = br.Exec()
		}
		if cerr := br.Close(); err == nil {
			err = cerr
		}
	}
	if !t.conn.IsClosed() && t.conn.PgConn().TxStatus() != 'I' {
		// A queued statement failed: the server skipped the COMMIT
		// behind it, and the transaction is aborted.
		_ = Rollback(ctx, t.tx)
	}
	switch {
	case err != nil:
		return err
	case tag.String() != "COMMIT":
		return fmt.Errorf("the server answered %s: %w", tag, pgx.ErrTxCommitRollback)
	}
	return nil
}

func (t *Tx) boundCommit(ctx context.Context) error {
	if n := t.last.Len(); n > 0 {
		br := t.tx.SendBatch(ctx, &t.last)
		var err error
		for i := 0; i < n && err == nil; i++ {
			_, err = br.Exec()
		}
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			_ = Rollback(ctx, t.tx)
			return err
		}
	}
	return t.tx.Commit(ctx)
}

// Rollback rolls the transaction back and returns the connection to its
// pool. After Commit or Rollback it does nothing.
func (t *Tx) Rollback(ctx context.Context) error {
	if t.ended {
		return nil
	}
	t.ended = true
	defer t.release()
	return Rollback(ctx, t.tx)
}
