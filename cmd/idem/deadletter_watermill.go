package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem/consumer"
)

// The poison queue of a Watermill router whose pub/sub is watermill-sql on
// PostgreSQL: a topic is the table "watermill_<topic>" (in --schema), one
// row per message with its UUID, payload and metadata. idem's middleware
// and Watermill's PoisonQueue write why a message was poisoned and where
// it came from into its metadata. A replay publishes the message to its
// source topic with its UUID and metadata (less those fields) and deletes
// the poison row in the same transaction, so a replay is never lost nor
// published twice; discard deletes the row. Rows are read page by page in
// the order they were published.

type watermillDLQ struct {
	pool   *pgxpool.Pool
	db     *sql.DB // the publisher's, on pool
	schema wmsql.DefaultPostgreSQLSchema
	table  string // the poison topic's, quoted
	page   []*deadLetter
	after  *watermillRef
	done   bool
}

// watermillRef is a poison row's primary key.
type watermillRef struct {
	txID   string // the xid8 of the transaction that published it
	offset int64
	meta   map[string]string
}

// errGoneWatermill says that another command removed a poison row first.
var errGoneWatermill = errors.New("it is no longer in the poison queue (replayed or discarded meanwhile)")

// watermillPage is how many poison rows one read takes.
const watermillPage = 200

func openWatermillDLQ(ctx context.Context, f *dlqFlags) (dlqBackend, error) {
	pool, err := f.pg.connect(ctx)
	if err != nil {
		return nil, err
	}
	w := &watermillDLQ{pool: pool, db: stdlib.OpenDBFromPool(pool)}
	w.schema = wmsql.DefaultPostgreSQLSchema{GenerateMessagesTableName: func(topic string) string {
		return pgx.Identifier{f.pg.schema, "watermill_" + topic}.Sanitize()
	}}
	w.table = w.schema.MessagesTable(f.watermill)
	var exists bool
	if err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", w.table).Scan(&exists); err != nil {
		_ = w.close(ctx)
		return nil, err
	}
	if !exists {
		_ = w.close(ctx)
		return nil, fmt.Errorf("no table %s: is %q the poison topic of a watermill-sql router in schema %q?", w.table, f.watermill, f.pg.schema)
	}
	return w, nil
}

func (w *watermillDLQ) describe() string { return "watermill-sql topic " + w.table }

func (w *watermillDLQ) next(ctx context.Context) (*deadLetter, error) {
	if len(w.page) == 0 && !w.done {
		if err := w.read(ctx); err != nil {
			return nil, err
		}
	}
	if len(w.page) == 0 {
		return nil, nil
	}
	d := w.page[0]
	w.page = w.page[1:]
	return d, nil
}

// read takes the next page of poison rows.
func (w *watermillDLQ) read(ctx context.Context) error {
	q := `SELECT transaction_id::text, "offset", uuid, created_at, payload, metadata::text FROM ` + w.table
	args := []any{}
	if w.after != nil {
		q += ` WHERE (transaction_id, "offset") > ($1::text::xid8, $2)`
		args = append(args, w.after.txID, w.after.offset)
	}
	q += ` ORDER BY transaction_id, "offset" LIMIT ` + strconv.Itoa(watermillPage)
	rows, err := w.pool.Query(ctx, q, args...)
	if err != nil {
		return err
	}
	page, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (*deadLetter, error) {
		var (
			ref     watermillRef
			uuid    string
			created time.Time
			payload []byte
			meta    *string
		)
		if err := row.Scan(&ref.txID, &ref.offset, &uuid, &created, &payload, &meta); err != nil {
			return nil, err
		}
		if meta != nil && *meta != "null" {
			if err := json.Unmarshal([]byte(*meta), &ref.meta); err != nil {
				return nil, fmt.Errorf("the metadata of poison row %d: %w", ref.offset, err)
			}
		}
		return watermillLetter(&ref, uuid, created, payload), nil
	})
	if err != nil {
		return err
	}
	w.page, w.done = page, len(page) < watermillPage
	if len(page) > 0 {
		w.after = page[len(page)-1].ref.(*watermillRef)
	}
	return nil
}

// watermillLetter reads a poison row's metadata: idem's dead-letter fields
// where idem's middleware set them, Watermill's PoisonQueue fields
// otherwise.
func watermillLetter(ref *watermillRef, uuid string, created time.Time, payload []byte) *deadLetter {
	m := ref.meta
	first := func(names ...string) string {
		for _, n := range names {
			if v := m[n]; v != "" {
				return v
			}
		}
		return ""
	}
	d := &deadLetter{
		pos: "offset:" + strconv.FormatInt(ref.offset, 10), id: uuid, msgID: uuid,
		reason:   first(consumer.HeaderReason),
		errText:  first(consumer.HeaderError, middleware.ReasonForPoisonedKey),
		attempts: m[consumer.HeaderAttempts],
		source:   first(consumer.HeaderSource, middleware.PoisonedTopicKey),
		at:       created, payload: payload, ref: ref,
	}
	if d.reason == "" {
		// Poisoned by Watermill's PoisonQueue, not by idem: its reason is
		// the handler's error text.
		d.reason = "poisoned"
	}
	names := make([]string, 0, len(m))
	for k := range m {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		d.headers = append(d.headers, header{k, m[k]})
	}
	return d
}

// poisonField reports whether name is a metadata field a poison queue
// adds, which a replay leaves out.
func poisonField(name string) bool {
	switch name {
	case middleware.ReasonForPoisonedKey, middleware.PoisonedTopicKey, middleware.PoisonedHandlerKey, middleware.PoisonedSubscriberKey:
		return true
	}
	return strings.HasPrefix(name, consumer.HeaderPrefix)
}

func (w *watermillDLQ) replay(ctx context.Context, d *deadLetter) (skip string, err error) {
	if d.source == "" {
		return "it has no " + consumer.HeaderSource + " or " + middleware.PoisonedTopicKey + " metadata: where it came from is not known", nil
	}
	ref := d.ref.(*watermillRef)
	msg := message.NewMessage(d.msgID, d.payload)
	for k, v := range ref.meta {
		if !poisonField(k) {
			msg.Metadata.Set(k, v)
		}
	}
	tx, err := w.db.BeginTx(ctx, nil)
	if err != nil {
		return "", err
	}
	defer func() {
		if err != nil || skip != "" {
			_ = tx.Rollback()
		}
	}()
	pub, err := wmsql.NewPublisher(tx, wmsql.PublisherConfig{SchemaAdapter: w.schema}, wm.NopLogger{})
	if err != nil {
		return "", err
	}
	if err := pub.Publish(d.source, msg); err != nil {
		return "", fmt.Errorf("publish to %s: %w", d.source, err)
	}
	gone, err := w.remove(ctx, tx, ref)
	if err != nil {
		return "", err
	}
	if gone {
		return errGoneWatermill.Error(), nil
	}
	return "", tx.Commit()
}

// remove deletes the poison row of ref in tx; gone reports that another
// command removed it first.
func (w *watermillDLQ) remove(ctx context.Context, tx *sql.Tx, ref *watermillRef) (gone bool, err error) {
	res, err := tx.ExecContext(ctx, `DELETE FROM `+w.table+` WHERE transaction_id = $1::text::xid8 AND "offset" = $2`, ref.txID, ref.offset)
	if err != nil {
		return false, err
	}
	n, err := res.RowsAffected()
	return n == 0, err
}

func (w *watermillDLQ) discard(ctx context.Context, d *deadLetter) error {
	tx, err := w.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	gone, err := w.remove(ctx, tx, d.ref.(*watermillRef))
	if err == nil && gone {
		err = errGoneWatermill
	}
	if err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}

func (w *watermillDLQ) close(context.Context) error {
	err := w.db.Close()
	w.pool.Close()
	return err
}
