package pgoutbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/outbox/internal/relaycore"
)

// Cleanup deletes published rows older than Options.Retention (and dead
// rows older than Options.DeadRetention, when set) in batches of
// Options.CleanupBatch, one statement per batch, until a batch comes back
// short. It returns the number of rows deleted. Rows another transaction
// holds locked are skipped.
func (o *Outbox) Cleanup(ctx context.Context) (int64, error) {
	if o.pool == nil {
		return 0, errNoPool("Cleanup")
	}
	total, err := o.deleteBatches(ctx, o.sql.cleanup, o.opts.Retention)
	if err != nil || o.opts.DeadRetention == 0 {
		return total, err
	}
	n, err := o.deleteBatches(ctx, o.sql.cleanupDead, o.opts.DeadRetention)
	return total + n, err
}

func (o *Outbox) deleteBatches(ctx context.Context, stmt string, age time.Duration) (int64, error) {
	return relaycore.DeleteBatches(ctx, o.opts.CleanupBatch, func(ctx context.Context) (int64, error) {
		tag, err := o.pool.Exec(ctx, stmt, age.Milliseconds(), o.opts.CleanupBatch)
		if err != nil {
			return 0, fmt.Errorf("pgoutbox: cleanup %s: %w", o.table, err)
		}
		return tag.RowsAffected(), nil
	})
}

// CleanupLoop runs Cleanup every interval until ctx ends, and returns
// ctx.Err(). Errors of single runs are logged and retried at the next tick.
// The caller owns the goroutine it runs in; a Relay runs one itself unless
// RelayOptions.CleanupInterval is negative.
func (o *Outbox) CleanupLoop(ctx context.Context, interval time.Duration) error {
	if interval <= 0 {
		return fmt.Errorf("pgoutbox: CleanupLoop interval is %v; it must be positive", interval)
	}
	if o.pool == nil {
		return errNoPool("CleanupLoop")
	}
	return relaycore.CleanupLoop(ctx, interval, o.Cleanup, o.opts.Logger, "pgoutbox: ", o.table)
}

// Backlog returns the number of pending (unpublished, not dead) messages and
// the age of the oldest one, by the database clock.
func (o *Outbox) Backlog(ctx context.Context) (pending int64, oldest time.Duration, err error) {
	if o.pool == nil {
		return 0, 0, errNoPool("Backlog")
	}
	var ms int64
	if err := o.pool.QueryRow(ctx, o.sql.backlog).Scan(&pending, &ms); err != nil {
		return 0, 0, fmt.Errorf("pgoutbox: backlog of %s: %w", o.table, err)
	}
	return pending, time.Duration(ms) * time.Millisecond, nil
}

// RequeueDead makes the dead messages with the given ids pending again, with
// their attempts reset, and returns how many it found. A requeued message
// keeps its place in its key's order: it is published before the key's
// pending later messages, but after those already published while it was
// dead.
func (o *Outbox) RequeueDead(ctx context.Context, ids ...string) (int64, error) {
	if o.pool == nil {
		return 0, errNoPool("RequeueDead")
	}
	var n int64
	err := pgx.BeginFunc(ctx, o.pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, o.sql.requeueDead, ids)
		if err != nil {
			return err
		}
		n = tag.RowsAffected()
		_, err = tx.Exec(ctx, o.sql.notify, o.channel)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("pgoutbox: requeue dead in %s: %w", o.table, err)
	}
	return n, nil
}
