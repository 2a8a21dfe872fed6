package sqloutbox

import (
	"context"
	"fmt"
	"time"

	"github.com/idemkit/idem/outbox/internal/relaycore"
)

// Cleanup deletes published rows older than Options.Retention (and dead
// rows older than Options.DeadRetention, when set) in batches of
// Options.CleanupBatch, one statement per batch (DELETE ... ORDER BY ...
// LIMIT on MySQL), until a batch comes back short. It returns the number of
// rows deleted.
func (o *Outbox) Cleanup(ctx context.Context) (int64, error) {
	if o.db == nil {
		return 0, errNoDB("Cleanup")
	}
	total, err := o.deleteBatches(ctx, o.sql.cleanup, o.opts.Retention)
	if err != nil || o.opts.DeadRetention == 0 {
		return total, err
	}
	n, err := o.deleteBatches(ctx, o.sql.cleanupDead, o.opts.DeadRetention)
	return total + n, err
}

func (o *Outbox) deleteBatches(ctx context.Context, stmt string, age time.Duration) (int64, error) {
	stmt = o.dialect.Rebind(stmt)
	return relaycore.DeleteBatches(ctx, o.opts.CleanupBatch, func(ctx context.Context) (int64, error) {
		res, err := o.db.ExecContext(ctx, stmt, age.Microseconds(), o.opts.CleanupBatch)
		if err != nil {
			return 0, fmt.Errorf("sqloutbox: cleanup %s: %w", o.table, err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return 0, fmt.Errorf("sqloutbox: cleanup %s: %w", o.table, err)
		}
		if h := o.afterCleanupBatch; h != nil {
			h(n)
		}
		return n, nil
	})
}

// CleanupLoop runs Cleanup every interval until ctx ends, and returns
// ctx.Err(). Errors of single runs are logged and retried at the next tick.
// The caller owns the goroutine it runs in; a Relay runs one itself unless
// RelayOptions.CleanupInterval is negative.
func (o *Outbox) CleanupLoop(ctx context.Context, interval time.Duration) error {
	if interval <= 0 {
		return fmt.Errorf("sqloutbox: CleanupLoop interval is %v; it must be positive", interval)
	}
	if o.db == nil {
		return errNoDB("CleanupLoop")
	}
	return relaycore.CleanupLoop(ctx, interval, o.Cleanup, o.opts.Logger, "sqloutbox: ", o.table)
}

// Backlog returns the number of pending (unpublished, not dead) messages and
// the age of the oldest one, by the database clock.
func (o *Outbox) Backlog(ctx context.Context) (pending int64, oldest time.Duration, err error) {
	if o.db == nil {
		return 0, 0, errNoDB("Backlog")
	}
	var us int64
	if err := o.db.QueryRowContext(ctx, o.sql.backlog).Scan(&pending, &us); err != nil {
		return 0, 0, fmt.Errorf("sqloutbox: backlog of %s: %w", o.table, err)
	}
	return pending, time.Duration(us) * time.Microsecond, nil
}

// RequeueDead makes the dead messages with the given ids pending again, with
// their attempts reset, and returns how many it found. A requeued message
// keeps its place in its key's order: it is published before the key's
// pending later messages, but after those already published while it was
// dead.
func (o *Outbox) RequeueDead(ctx context.Context, ids ...string) (int64, error) {
	if o.db == nil {
		return 0, errNoDB("RequeueDead")
	}
	var total int64
	for start := 0; start < len(ids); start += insertChunk {
		chunk := ids[start:min(start+insertChunk, len(ids))]
		args := make([]any, len(chunk))
		for i, id := range chunk {
			args[i] = id
		}
		res, err := o.db.ExecContext(ctx, o.dialect.Rebind(in(o.sql.requeueDead, len(chunk))), args...)
		if err != nil {
			return total, fmt.Errorf("sqloutbox: requeue dead in %s: %w", o.table, err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return total, fmt.Errorf("sqloutbox: requeue dead in %s: %w", o.table, err)
		}
		total += n
	}
	return total, nil
}
