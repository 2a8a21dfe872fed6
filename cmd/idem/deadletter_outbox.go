package main

import (
	"context"
	"fmt"
	"sort"
	"strconv"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// The outbox's dead rows (outbox/pgoutbox): a relay parked them after its
// last failed publish. A replay makes a row pending again (RequeueDead),
// and a relay publishes it with its id; discard deletes it (DeleteDead).
// Rows are read page by page in the order they were parked.

type outboxDLQ struct {
	pool  *pgxpool.Pool
	ob    *pgoutbox.Outbox
	page  []pgoutbox.DeadMessage
	after *pgoutbox.DeadMessage
	done  bool
	// shared is set when the pool belongs to someone else (the
	// console's): close leaves it open.
	shared bool
}

// outboxPage is how many dead rows one read takes.
const outboxPage = 200

func openOutboxDLQ(ctx context.Context, f *dlqFlags) (dlqBackend, error) {
	pool, err := f.pg.connect(ctx)
	if err != nil {
		return nil, err
	}
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: f.pg.schema, Table: f.pg.outboxTable})
	if err != nil {
		pool.Close()
		return nil, err
	}
	return &outboxDLQ{pool: pool, ob: ob}, nil
}

func (o *outboxDLQ) describe() string { return "outbox " + o.ob.Table() }

func (o *outboxDLQ) next(ctx context.Context) (*deadLetter, error) {
	if len(o.page) == 0 && !o.done {
		page, err := o.ob.Dead(ctx, o.after, outboxPage)
		if err != nil {
			return nil, err
		}
		o.page, o.done = page, len(page) < outboxPage
		if len(page) > 0 {
			o.after = &page[len(page)-1]
		}
	}
	if len(o.page) == 0 {
		return nil, nil
	}
	m := o.page[0]
	o.page = o.page[1:]
	d := &deadLetter{
		pos: "seq:" + strconv.FormatInt(m.Seq, 10), id: m.ID, msgID: m.ID,
		// A relay parks a message after its last attempt: its retries ran out.
		reason: string(consumer.OutcomeRetriesExhausted), errText: m.LastError,
		attempts: strconv.Itoa(m.Attempts), source: m.Topic, at: m.DeadAt, key: m.Key, payload: m.Payload,
	}
	names := make([]string, 0, len(m.Headers))
	for k := range m.Headers {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		d.headers = append(d.headers, header{k, m.Headers[k]})
	}
	d.headers = append(d.headers, header{"(enqueued at)", timeText(m.CreatedAt)})
	return d, nil
}

func (o *outboxDLQ) replay(ctx context.Context, d *deadLetter) (string, error) {
	n, err := o.ob.RequeueDead(ctx, d.id)
	if err != nil {
		return "", err
	}
	if n == 0 {
		return "it is no longer dead (requeued or deleted meanwhile)", nil
	}
	return "", nil
}

func (o *outboxDLQ) discard(ctx context.Context, d *deadLetter) error {
	n, err := o.ob.DeleteDead(ctx, d.id)
	if err == nil && n == 0 {
		err = fmt.Errorf("message %s is no longer dead (requeued or deleted meanwhile)", d.id)
	}
	return err
}

func (o *outboxDLQ) close(context.Context) error {
	if !o.shared {
		o.pool.Close()
	}
	return nil
}
