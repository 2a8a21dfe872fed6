package pgoutbox

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// DeadMessage is a message a relay parked as dead after its last failed
// attempt.
type DeadMessage struct {
	// Seq is the row's place in the table's order.
	Seq int64
	// ID is the message id, kept when it is requeued.
	ID       string
	Topic    string
	Key      []byte
	Payload  []byte
	Headers  map[string]string
	Attempts int
	// LastError is the error of the last attempt.
	LastError string
	// CreatedAt is when it was enqueued, DeadAt when it was parked
	// (database clock).
	CreatedAt, DeadAt time.Time
}

// Dead returns up to limit dead messages, in the order they were parked:
// the first ones when after is nil, else those parked after it (the last
// message of the previous page). Each page is a range scan of the index
// of dead rows.
func (o *Outbox) Dead(ctx context.Context, after *DeadMessage, limit int) ([]DeadMessage, error) {
	if o.pool == nil {
		return nil, errNoPool("Dead")
	}
	if limit <= 0 {
		return nil, fmt.Errorf("pgoutbox: Dead: limit is %d; it must be positive", limit)
	}
	from, seq := time.Time{}, int64(math.MinInt64)
	if after != nil {
		from, seq = after.DeadAt, after.Seq
	}
	since := pgtype.Timestamptz{Time: from, Valid: true}
	if after == nil {
		since = pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}
	}
	rows, err := o.pool.Query(ctx, o.sql.deadPage, since, seq, limit)
	if err != nil {
		return nil, fmt.Errorf("pgoutbox: dead messages of %s: %w", o.table, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeadMessage, error) {
		var m DeadMessage
		err := r.Scan(&m.Seq, &m.ID, &m.Topic, &m.Key, &m.Payload, &m.Headers, &m.Attempts, &m.LastError, &m.CreatedAt, &m.DeadAt)
		return m, err
	})
	if err != nil {
		return nil, fmt.Errorf("pgoutbox: dead messages of %s: %w", o.table, err)
	}
	return out, nil
}

// DeleteDead deletes the dead messages with the given ids, without
// publishing them, and returns how many it found.
func (o *Outbox) DeleteDead(ctx context.Context, ids ...string) (int64, error) {
	if o.pool == nil {
		return 0, errNoPool("DeleteDead")
	}
	tag, err := o.pool.Exec(ctx, o.sql.deleteDead, ids)
	if err != nil {
		return 0, fmt.Errorf("pgoutbox: delete dead in %s: %w", o.table, err)
	}
	return tag.RowsAffected(), nil
}
