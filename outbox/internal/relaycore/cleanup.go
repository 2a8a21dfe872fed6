package relaycore

import (
	"context"
	"log/slog"
	"time"
)

// DeleteBatches runs del, one statement deleting at most batch rows that
// returns how many it deleted, until a statement comes back short or ctx
// ends. It returns the number of rows deleted.
func DeleteBatches(ctx context.Context, batch int, del func(ctx context.Context) (int64, error)) (int64, error) {
	var total int64
	for {
		n, err := del(ctx)
		if err != nil {
			return total, err
		}
		total += n
		if n < int64(batch) {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
}

// CleanupLoop runs cleanup every interval, the first time at once, until
// ctx ends, and returns ctx.Err(). A failed run is logged as a warning and
// retried at the next tick; a run that deleted rows is logged at debug
// level. Log lines start with prefix ("pgoutbox: ") and name table.
func CleanupLoop(ctx context.Context, interval time.Duration, cleanup func(context.Context) (int64, error),
	log *slog.Logger, prefix, table string) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		n, err := cleanup(ctx)
		if err != nil && ctx.Err() == nil {
			log.Warn(prefix+"cleanup failed", "table", table, "err", err)
		} else if n > 0 {
			log.Debug(prefix+"cleanup", "table", table, "deleted", n)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}
