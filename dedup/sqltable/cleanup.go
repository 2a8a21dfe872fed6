package sqltable

import (
	"context"
	"database/sql"
	"fmt"
	"time"
)

// Cleanup deletes expired rows (completed keys past their retention, leases
// that ran out) in batches of Options.CleanupBatch, until a batch comes
// back short. It returns the number of rows deleted. Each batch takes the
// rows that expired before the call began, in expires_at order, through
// the expires_at index, so its cost does not grow with the table.
//
// On PostgreSQL a batch is one statement that skips the rows a running
// claim holds locked. On MySQL and MariaDB it is a short READ COMMITTED
// transaction (no gap locks, so no claim waits for it): a SELECT ... FOR
// UPDATE SKIP LOCKED of the batch, then the DELETE of what it found. On
// SQLite it is one statement, which takes the single writer's lock for
// its time.
func (s *Store) Cleanup(ctx context.Context) (int64, error) {
	// One cutoff for the whole call: rows that expire while it runs wait
	// for the next call, so a call's work is bounded.
	var cutoff any
	if err := s.db.QueryRowContext(ctx, s.sql.now).Scan(&cutoff); err != nil {
		return 0, fmt.Errorf("sqltable: cleanup %s: %w", s.table, err)
	}
	if b, ok := cutoff.([]byte); ok {
		cutoff = string(b)
	}
	var total int64
	for {
		var (
			n   int64
			err error
		)
		if s.dialect == MySQL {
			n, err = s.cleanupMySQL(ctx, cutoff)
		} else {
			var res sql.Result
			res, err = s.db.ExecContext(ctx, s.sql.cleanup, cutoff, s.opts.CleanupBatch)
			if err == nil {
				n, err = res.RowsAffected()
			}
		}
		if err != nil {
			return total, fmt.Errorf("sqltable: cleanup %s: %w", s.table, err)
		}
		total += n
		if n < int64(s.opts.CleanupBatch) {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
}

// cleanupMySQL deletes one batch. A batch that found rows all locked by
// claims deletes nothing and ends the call.
func (s *Store) cleanupMySQL(ctx context.Context, cutoff any) (int64, error) {
	tx, err := s.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback() }()
	rows, err := tx.QueryContext(ctx, s.sql.cleanupSelect, cutoff, s.opts.CleanupBatch)
	if err != nil {
		return 0, fmt.Errorf("select a batch: %w", err)
	}
	var digests [][]byte
	for rows.Next() {
		var d []byte
		if err := rows.Scan(&d); err != nil {
			_ = rows.Close()
			return 0, err
		}
		digests = append(digests, d)
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	_ = rows.Close()
	if len(digests) == 0 {
		return 0, tx.Commit()
	}
	// One DELETE by primary key per row: a DELETE of a list of keys may
	// be planned as a scan of the table, which waits for the rows claims
	// hold locked.
	del, err := tx.PrepareContext(ctx, s.sql.cleanupDelete)
	if err != nil {
		return 0, fmt.Errorf("delete a batch: %w", err)
	}
	defer func() { _ = del.Close() }()
	var n int64
	for _, d := range digests {
		res, err := del.ExecContext(ctx, d)
		if err != nil {
			return 0, fmt.Errorf("delete a batch: %w", err)
		}
		m, err := res.RowsAffected()
		if err != nil {
			return 0, fmt.Errorf("delete a batch: %w", err)
		}
		n += m
	}
	if err := tx.Commit(); err != nil {
		return 0, err
	}
	return n, nil
}

// CleanupLoop runs Cleanup every interval until ctx ends, and returns
// ctx.Err(). Errors of single runs are logged and retried at the next tick.
// The caller owns the goroutine it runs in:
//
//	ctx, cancel := context.WithCancel(ctx)
//	go store.CleanupLoop(ctx, time.Minute)
//	defer cancel()
func (s *Store) CleanupLoop(ctx context.Context, interval time.Duration) error {
	if interval <= 0 {
		return fmt.Errorf("sqltable: CleanupLoop interval is %v; it must be positive", interval)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		n, err := s.Cleanup(ctx)
		if err != nil && ctx.Err() == nil {
			s.opts.Logger.Warn("sqltable: cleanup failed", "table", s.table, "err", err)
		} else if n > 0 {
			s.opts.Logger.Debug("sqltable: cleanup", "table", s.table, "deleted", n)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}
