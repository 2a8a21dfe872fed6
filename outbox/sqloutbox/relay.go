package sqloutbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/internal/relaycore"
)

// RelayOptions configure a Relay. The zero value is usable. The names are
// those of outbox/pgoutbox's RelayOptions where they mean the same.
type RelayOptions struct {
	// Sessions is the number of claim loops this relay runs, each in its
	// own transactions, like that many separate relays. More than one
	// lets one process publish several batches at once, but the relay then
	// calls Publish from several goroutines at once: use it only with a
	// Publisher that is safe for concurrent use (the adapters/amqp
	// publisher is). On SQLite it must be 1. Defaults to 1.
	Sessions int
	// BatchSize is the most messages one claim takes. A batch holds at
	// most one message per key: a key's next message is claimed only
	// after the previous one was confirmed and marked (pgoutbox's
	// PerKeyBatch of 1). Defaults to 500.
	BatchSize int
	// PollInterval is how long a session waits before it looks for work
	// again after a claim found nothing. There is no notification on
	// MySQL or SQLite: this is the delay between a commit and its
	// publication when the relay is idle. Defaults to 1s.
	PollInterval time.Duration
	// MaxAttempts is the number of failed publish attempts after which a
	// message is parked as dead. Only per-message failures count (an
	// *outbox.PublishError naming the message); an error for the whole
	// batch (the broker unreachable) counts no attempt. Defaults to 10.
	MaxAttempts int
	// Backoff spaces the attempts of a failed message: after its n-th
	// failed attempt it waits Backoff.Delay(n), spread ±20%. Initial must
	// be at least 1ms. A failed message holds back the later messages of
	// its key until it is published or dead; other keys go on. Defaults
	// to Initial 1s, Max 5m, Factor 2. The consumer's dedup retention must
	// outlive that horizon.
	Backoff consumer.Backoff
	// ReconnectBackoff spaces a session's retries after a database error
	// or a batch whose Publish failed as a whole: Initial, growing by
	// Factor up to Max, each spread ±20%, and Initial again after a
	// success. Defaults to Initial 100ms, Max 10s, Factor 2.
	ReconnectBackoff consumer.Backoff
	// DeletePublished deletes a row once its message is confirmed instead
	// of marking it published. Defaults to false (marked, and deleted by
	// Cleanup after Options.Retention).
	DeletePublished bool
	// CleanupInterval is how often the relay runs Outbox.Cleanup.
	// Negative disables it. Defaults to 1 minute.
	CleanupInterval time.Duration
	// ShutdownTimeout is how long the batch in flight when Run's context
	// ends may take to finish (publish and mark). Defaults to 10s.
	ShutdownTimeout time.Duration
	// QueryTimeout bounds each database statement of a session. Defaults
	// to 30s.
	QueryTimeout time.Duration
	// Telemetry: the relay's metrics, spans and logs (consumer's block,
	// shared by every adapter and relay).
	//
	// MeterProvider receives the counters idem.outbox.published, .retried
	// and .dead (attributes idem.outbox.table, messaging.destination.name
	// = topic), counted when the marks of a batch committed, and the
	// histogram idem.outbox.publish.duration (one per batch, idem.result
	// ok or error), as outbox/pgoutbox's relay records them. Defaults to
	// otel.GetMeterProvider(), a no-op until the application installs a
	// provider.
	//
	// TracerProvider starts a producer span per published batch,
	// "publish <topic>", linked to the trace context each message carries
	// from Enqueue. Defaults to otel.GetTracerProvider().
	//
	// Logger receives warnings (database errors, publish failures,
	// messages parked dead; message ids only as dedup.HashKey("", id)).
	// Defaults to the Outbox's logger.
	//
	// OnOutcome must be nil: a relay publishes rows and settles no
	// consumer message, so it has no consumer.Report to give; the counters
	// above count its messages. NewRelay refuses a set OnOutcome.
	consumer.Telemetry
}

// Relay publishes the committed rows of an Outbox on MySQL, MariaDB or
// SQLite through a Publisher. See the package documentation for how many
// may run at once.
type Relay struct {
	ob      *Outbox
	pub     outbox.Publisher
	opts    RelayOptions
	running atomic.Bool
	hooks   hooks
	tel     *relaycore.Telemetry
}

// hooks are test seams (set through export_test.go).
type hooks struct {
	// afterPublish runs after Publish returned and before the rows are
	// marked, with the claim's transaction (nil on SQLite).
	afterPublish func(tx *sql.Tx, msgs []*outbox.Message, err error)
}

// errFatal marks errors that stop Run: misconfiguration, not outages.
var errFatal = errors.New("sqloutbox: relay cannot run")

// NewRelay returns a relay for ob that publishes through pub. It does not
// touch the database or the broker.
//
// It refuses an Outbox on PostgreSQL: such a table has outbox/pgoutbox's
// layout, and pgoutbox's Relay (on a pgxpool.Pool of the same database,
// with the same Schema and Table) publishes it, woken by the notification
// Enqueue sends.
func NewRelay(ob *Outbox, pub outbox.Publisher, opts RelayOptions) (*Relay, error) {
	if ob == nil || ob.db == nil {
		return nil, errors.New("sqloutbox: NewRelay: outbox is nil or has no *sql.DB; create it with New")
	}
	if ob.dialect == Postgres {
		return nil, fmt.Errorf("sqloutbox: NewRelay: %s is on PostgreSQL, where the relay is outbox/pgoutbox's: "+
			"run pgoutbox.NewRelay on a pgxpool.Pool with Schema %q and Table %q", ob.table, ob.opts.Schema, ob.opts.Table)
	}
	if pub == nil {
		return nil, errors.New("sqloutbox: NewRelay: publisher is nil; pass an outbox.Publisher such as adapters/amqp's")
	}
	if err := opts.fill(ob); err != nil {
		return nil, err
	}
	table := ob.opts.Table
	if ob.opts.Schema != "" {
		table = ob.opts.Schema + "." + table
	}
	tel := relaycore.NewTelemetry(opts.MeterProvider, opts.TracerProvider, table,
		"Time from an outbox row becoming available to the broker's confirmation.")
	return &Relay{ob: ob, pub: pub, opts: opts, tel: tel}, nil
}

func (o *RelayOptions) fill(ob *Outbox) error {
	const prefix = "sqloutbox: RelayOptions."
	err := relaycore.FillInts(prefix,
		relaycore.Int{Name: "Sessions", V: &o.Sessions, Def: 1, Max: 64},
		relaycore.Int{Name: "BatchSize", V: &o.BatchSize, Def: 500, Max: insertChunk},
		relaycore.Int{Name: "MaxAttempts", V: &o.MaxAttempts, Def: 10, Max: 1 << 20})
	if err != nil {
		return err
	}
	if ob.dialect == SQLite && o.Sessions != 1 {
		return fmt.Errorf("sqloutbox: RelayOptions.Sessions is %d; SQLite has no SKIP LOCKED, so it runs one relay with one session", o.Sessions)
	}
	err = relaycore.FillDurations(prefix,
		relaycore.Duration{Name: "PollInterval", V: &o.PollInterval, Def: time.Second},
		relaycore.Duration{Name: "ShutdownTimeout", V: &o.ShutdownTimeout, Def: 10 * time.Second},
		relaycore.Duration{Name: "QueryTimeout", V: &o.QueryTimeout, Def: 30 * time.Second})
	if err != nil {
		return err
	}
	return relaycore.FillCommon(prefix, relaycore.Common{
		Backoff: &o.Backoff, BackoffDef: consumer.Backoff{Initial: time.Second, Max: 5 * time.Minute, Factor: 2},
		ReconnectBackoff: &o.ReconnectBackoff, CleanupInterval: &o.CleanupInterval, Telemetry: &o.Telemetry,
	}, ob.opts.Logger)
}

// Options returns the relay's options with defaults filled in.
func (r *Relay) Options() RelayOptions { return r.opts }

// Run publishes until ctx ends, then lets the batches in flight finish (see
// RelayOptions.ShutdownTimeout), stops every goroutine it started and
// returns nil. It returns an error without waiting for ctx when the relay
// cannot work at all (the table does not exist: run Migrate; the server
// does not know SKIP LOCKED), and when called while already running.
//
// On MySQL each session claims a batch in a READ COMMITTED transaction
// with SELECT ... FOR UPDATE SKIP LOCKED, publishes it while the
// transaction holds the rows, marks them and commits: other relays skip
// the rows held and the later messages of their keys. A session whose
// connection drops loses its claim; the rows are claimed again and
// published again with the same ids. On SQLite the single session reads a
// batch, publishes it and marks it in a short write transaction, so
// writers are never held up by a publish.
//
// Every outage is retried, never returned: the database unreachable, the
// connection killed, the broker down.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("sqloutbox: Relay.Run called while the relay is running")
	}
	defer r.running.Store(false)

	loops := make([]func(context.Context, context.CancelCauseFunc), 0, r.opts.Sessions+1)
	for i := range r.opts.Sessions {
		loops = append(loops, func(ctx context.Context, stop context.CancelCauseFunc) { r.sessionLoop(ctx, i, stop) })
	}
	if r.opts.CleanupInterval > 0 {
		loops = append(loops, func(ctx context.Context, _ context.CancelCauseFunc) {
			_ = r.ob.CleanupLoop(ctx, r.opts.CleanupInterval)
		})
	}
	return relaycore.Run(ctx, errFatal, loops...)
}

// sessionLoop claims and publishes until ctx ends, retrying errors with
// backoff.
func (r *Relay) sessionLoop(ctx context.Context, idx int, stop context.CancelCauseFunc) {
	o := &r.opts
	bo := relaycore.Growing(o.ReconnectBackoff)
	var nextDue time.Time // the earliest retry this session scheduled
	for ctx.Err() == nil {
		n, due, err := r.cycle(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if fatal := r.fatal(err); fatal != nil {
				o.Logger.Error("sqloutbox: relay stopped", "table", r.ob.table, "err", fatal)
				stop(fatal)
				return
			}
			d := bo.Next()
			o.Logger.Warn("sqloutbox: relay cycle failed; retrying", "table", r.ob.table, "session", idx, "in", d, "err", err)
			if !backoff.Sleep(ctx, d) {
				return
			}
			continue
		}
		bo.Reset()
		if !due.IsZero() && (nextDue.IsZero() || due.Before(nextDue)) {
			nextDue = due
		}
		if n > 0 {
			continue // more may be claimable: the next messages of the keys just marked
		}
		wait := o.PollInterval
		if !nextDue.IsZero() {
			if until := time.Until(nextDue); until < wait {
				wait = max(until, time.Millisecond)
				nextDue = time.Time{}
			}
		}
		if !backoff.Sleep(ctx, wait) {
			return
		}
	}
}

// claimed is one row of a claim.
type claimed struct {
	seq      int64
	attempts int
	msg      *outbox.Message
}

// cycle claims one batch, publishes it and marks it. It returns the
// number of messages claimed and, when some failed, the earliest time one
// of them is due again.
func (r *Relay) cycle(ctx context.Context) (int, time.Time, error) {
	o := &r.opts
	fctx, release := relaycore.Graceful(ctx, o.ShutdownTimeout)
	defer release()
	var tx *sql.Tx
	var batch []claimed
	var err error
	if r.ob.dialect == MySQL {
		tx, err = r.ob.db.BeginTx(fctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
		if err != nil {
			return 0, time.Time{}, fmt.Errorf("begin: %w", err)
		}
		batch, err = r.claim(fctx, tx)
	} else {
		batch, err = r.claim(fctx, r.ob.db)
	}
	if err != nil || len(batch) == 0 {
		if tx != nil {
			_ = tx.Rollback()
		}
		return 0, time.Time{}, err
	}
	msgs := make([]*outbox.Message, len(batch))
	for i, c := range batch {
		msgs[i] = c.msg
	}
	pe, _, err := relaycore.Publish(fctx, r.tel, r.pub, msgs, "", func(msgs []*outbox.Message, err error) {
		if h := r.hooks.afterPublish; h != nil {
			h(tx, msgs, err)
		}
	})
	if err != nil {
		if tx != nil {
			_ = tx.Rollback()
		}
		return 0, time.Time{}, err
	}
	if tx == nil {
		if tx, err = r.ob.db.BeginTx(fctx, nil); err != nil {
			return 0, time.Time{}, fmt.Errorf("mark: begin: %w", err)
		}
	}
	var counts markCounts
	due, err := r.mark(fctx, tx, batch, pe, &counts)
	if err != nil {
		_ = tx.Rollback()
		return 0, time.Time{}, fmt.Errorf("mark: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return 0, time.Time{}, fmt.Errorf("mark: commit: %w", err)
	}
	r.tel.Count(fctx, r.tel.Published, counts.published)
	r.tel.Count(fctx, r.tel.Retried, counts.retried)
	r.tel.Count(fctx, r.tel.Dead, counts.dead)
	return len(batch), due, nil
}

// claim reads a batch: on MySQL locking the rows in tx, on SQLite plainly.
func (r *Relay) claim(ctx context.Context, q queryer) ([]claimed, error) {
	qctx, cancel := context.WithTimeout(ctx, r.opts.QueryTimeout)
	defer cancel()
	rows, err := q.QueryContext(qctx, r.ob.sql.claim, r.opts.BatchSize)
	if err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	defer func() { _ = rows.Close() }()
	var out []claimed
	for rows.Next() {
		var (
			c       claimed
			id      string
			topic   string
			key     []byte
			payload []byte
			headers string
			created int64
		)
		if err := rows.Scan(&c.seq, &id, &topic, &key, &payload, &headers, &created, &c.attempts); err != nil {
			return nil, fmt.Errorf("claim: %w", err)
		}
		m := &outbox.Message{
			ID:        id,
			Topic:     topic,
			Payload:   payload,
			CreatedAt: time.UnixMicro(created).UTC(),
			Attempt:   c.attempts + 1,
		}
		if m.Payload == nil {
			m.Payload = []byte{}
		}
		if len(key) > 0 {
			m.Key = key
		}
		if headers != "" && headers != "{}" {
			m.Headers = relaycore.DecodeHeaders(headers)
		}
		c.msg = m
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	return out, nil
}

// markCounts are the messages of a batch marked published, retried and
// dead, per topic.
type markCounts struct {
	published, retried, dead map[string]int
}

// add counts one message of topic in *m, making the map.
func (markCounts) add(m *map[string]int, topic string) {
	if *m == nil {
		*m = map[string]int{}
	}
	(*m)[topic]++
}

// mark writes the outcome of a publish whose per-message failures are pe
// (nil: all published) in tx, and counts it in counts. It returns the
// earliest time a failed, not dead message is due again.
func (r *Relay) mark(ctx context.Context, tx *sql.Tx, batch []claimed, pe *outbox.PublishError, counts *markCounts) (time.Time, error) {
	o := &r.opts
	qctx, cancel := context.WithTimeout(ctx, o.QueryTimeout)
	defer cancel()
	var (
		ok  []any
		due time.Time
	)
	for i, c := range batch {
		failed, ferr := relaycore.Failed(pe, i)
		if !failed {
			ok = append(ok, c.seq)
			counts.add(&counts.published, c.msg.Topic)
			continue
		}
		n := c.attempts + 1
		state := 0
		delay := relaycore.RetryDelay(o.Backoff, n)
		if n >= o.MaxAttempts {
			state = 2
			counts.add(&counts.dead, c.msg.Topic)
			o.Logger.Warn("sqloutbox: message parked as dead", "table", r.ob.table, "id_hash", dedup.HashKey("", c.msg.ID),
				"topic", c.msg.Topic, "attempts", n, "err", ferr)
		} else {
			counts.add(&counts.retried, c.msg.Topic)
			if at := time.Now().Add(delay); due.IsZero() || at.Before(due) {
				due = at
			}
		}
		if _, err := tx.ExecContext(qctx, r.ob.sql.markFailed, relaycore.Truncate(ferr.Error(), 2000), delay.Microseconds(), state, state, c.seq); err != nil {
			return time.Time{}, err
		}
	}
	if len(ok) > 0 {
		stmt := r.ob.sql.markPublished
		if o.DeletePublished {
			stmt = r.ob.sql.markDelete
		}
		if _, err := tx.ExecContext(qctx, in(stmt, len(ok)), ok...); err != nil {
			return time.Time{}, err
		}
	}
	return due, nil
}

// fatal returns an errFatal error when err means the relay cannot work at
// all, nil for an outage.
func (r *Relay) fatal(err error) error {
	switch {
	case missingTable(r.ob.dialect, err):
		return fmt.Errorf("%w: %s does not exist; run Migrate: %w", errFatal, r.ob.table, err)
	case r.ob.dialect == MySQL && mysqlErrorNumber(err) == 1064:
		return fmt.Errorf("%w: the server does not understand the claim; the relay needs FOR UPDATE SKIP LOCKED (MySQL 8, MariaDB 10.6 or later): %w", errFatal, err)
	}
	return nil
}

// missingTable reports whether err says the outbox table does not exist,
// without importing a driver.
func missingTable(d Dialect, err error) bool {
	if d == MySQL {
		return mysqlErrorNumber(err) == 1146 // ER_NO_SUCH_TABLE
	}
	return strings.Contains(err.Error(), "no such table")
}

// mysqlErrorNumber returns the server error number of a
// go-sql-driver/mysql error (a *MySQLError, whose Number field has no
// accessor method) in err's chain, or 0.
func mysqlErrorNumber(err error) uint64 {
	for e := err; e != nil; e = errors.Unwrap(e) {
		v := reflect.ValueOf(e)
		if v.Kind() == reflect.Pointer {
			if v.IsNil() {
				continue
			}
			v = v.Elem()
		}
		if v.Kind() != reflect.Struct {
			continue
		}
		if f := v.FieldByName("Number"); f.IsValid() && f.CanUint() && v.FieldByName("SQLState").IsValid() {
			return f.Uint()
		}
	}
	return 0
}
