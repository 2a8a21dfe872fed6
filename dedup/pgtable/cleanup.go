package pgtable

import (
	"context"
	"fmt"
	"time"
)

// Cleanup deletes expired rows (completed keys past their retention, leases
// that ran out) in batches of Options.CleanupBatch, one statement per batch,
// until a batch comes back short. It returns the number of rows deleted.
// Rows a running claim holds locked are skipped. Each batch takes the rows
// that expired before the call began, in expires_at order, through the
// expires_at index, so its cost does not grow with the table.
//
// With Options.Partitioned, Cleanup detaches the partitions whose time range
// has passed, concurrently and under Options.PartitionLockTimeout, and drops
// them; claims never wait for it. A partition still read by a transaction
// older than the detach is finished by a later call. It needs a
// *pgxpool.Pool or *pgx.Conn then, not a pgx.Tx, that reaches PostgreSQL
// itself: through a pooler (PgBouncer) it returns an error that says so.
func (s *Store) Cleanup(ctx context.Context) (int64, error) {
	if s.opts.Partitioned {
		return s.cleanupPartitioned(ctx)
	}
	// One cutoff for the whole call: rows that expire while it runs wait
	// for the next call, so a call's work is bounded.
	cutoff, err := dbNow(ctx, s.db)
	if err != nil {
		return 0, fmt.Errorf("pgtable: cleanup %s: %w", s.table, err)
	}
	var total int64
	for {
		tag, err := s.db.Exec(ctx, s.sql.cleanup, s.opts.CleanupBatch, cutoff)
		if err != nil {
			return total, fmt.Errorf("pgtable: cleanup %s: %w", s.table, err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(s.opts.CleanupBatch) {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
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
		return fmt.Errorf("pgtable: CleanupLoop interval is %v; it must be positive", interval)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if err := s.EnsurePartitions(ctx); err != nil && ctx.Err() == nil {
			s.opts.Logger.Warn("pgtable: creating partitions failed", "table", s.table, "err", err)
		}
		n, err := s.Cleanup(ctx)
		if err != nil && ctx.Err() == nil {
			s.opts.Logger.Warn("pgtable: cleanup failed", "table", s.table, "err", err)
		} else if n > 0 {
			s.opts.Logger.Debug("pgtable: cleanup", "table", s.table, "deleted", n)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}
