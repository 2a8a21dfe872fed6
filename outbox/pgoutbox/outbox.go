package pgoutbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/propagation"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/sqlname"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/internal/msgcheck"
	"github.com/idemkit/idem/outbox/internal/relaycore"
)

// Options configure an Outbox. The zero value is usable.
type Options struct {
	// Schema holds the table. Defaults to "public".
	Schema string
	// Table is the table name. Defaults to "outbox".
	Table string
	// Propagator adds the trace context of Enqueue's ctx to each message's
	// headers. Defaults to W3C Trace Context (propagation.TraceContext{}):
	// the OpenTelemetry span context of ctx as traceparent and tracestate,
	// whatever the global propagator is. Pass otel.GetTextMapPropagator(),
	// or a composite with propagation.Baggage{}, to carry more, and
	// propagation.NewCompositeTextMapPropagator() to carry nothing.
	Propagator propagation.TextMapPropagator
	// NoKeyLock disables the per-key advisory lock Enqueue takes (see
	// Enqueue). Messages of one key are then ordered by the order in which
	// their rows were inserted, not committed: two transactions enqueueing
	// the same key concurrently may see their messages published in the
	// other order. Defaults to false (ordered by commit).
	NoKeyLock bool
	// NoNotify stops Enqueue from sending its pg_notify. PostgreSQL
	// serializes the commits of transactions that sent a notification (the
	// notification queue's lock is held through the commit's flush to
	// disk), so many concurrent transactions that enqueue commit one flush
	// at a time instead of sharing flushes; without the notification they
	// commit as they would without the outbox. The relays then find new
	// rows by polling alone: set RelayOptions.PollInterval to the delay
	// you accept (a poll that finds nothing is one index probe). Defaults
	// to false (notify).
	NoNotify bool
	// Retention is how long published rows are kept before Cleanup
	// deletes them. Defaults to 24 hours.
	Retention time.Duration
	// DeadRetention is how long dead rows are kept before Cleanup deletes
	// them. Defaults to 0: dead rows are kept until deleted by hand or
	// requeued with RequeueDead.
	DeadRetention time.Duration
	// CleanupBatch is the number of rows one cleanup statement deletes.
	// Defaults to 1000.
	CleanupBatch int
	// Logger receives the cleanup loop's warnings, and the relays'
	// unless RelayOptions.Logger is set. Message ids and keys are never
	// logged, only their hash (dedup.HashKey("", id)). Defaults to
	// slog.Default().
	Logger *slog.Logger
}

// Outbox is an outbox table: Enqueue writes to it in the caller's
// transaction, a Relay publishes from it. It is safe for concurrent use.
type Outbox struct {
	pool    *pgxpool.Pool // nil for an Outbox that only enqueues
	opts    Options
	table   string // quoted, schema-qualified
	channel string // LISTEN/NOTIFY channel
	lockNS  int64  // advisory lock namespace of the keys
	relayNS int32  // advisory lock namespace of the relays' shards
	sql     statements
}

// New returns the Outbox of the table named by opts, on pool. It does not
// touch the database; call Migrate (or apply SQL) once before use.
//
// pool may be nil for an Outbox that only enqueues (Enqueue runs in the
// caller's transaction) or prints its SQL; Migrate, MigrationStatus,
// Cleanup, Backlog, RequeueDead and NewRelay need it.
func New(pool *pgxpool.Pool, opts Options) (*Outbox, error) {
	if err := sqlname.SchemaTable("pgoutbox: Options", &opts.Schema, &opts.Table, "outbox", 50); err != nil {
		return nil, err
	}
	if err := relaycore.CheckRetentions("pgoutbox: Options.",
		relaycore.Duration{Name: "Retention", V: &opts.Retention},
		relaycore.Duration{Name: "DeadRetention", V: &opts.DeadRetention}); err != nil {
		return nil, err
	}
	if err := relaycore.FillOutbox("pgoutbox: Options.", relaycore.OutboxDefaults{
		Retention: &opts.Retention, CleanupBatch: &opts.CleanupBatch, Propagator: &opts.Propagator, Logger: &opts.Logger,
	}); err != nil {
		return nil, err
	}
	o := &Outbox{
		pool:  pool,
		opts:  opts,
		table: sqlname.Qualified(opts.Schema, opts.Table),
	}
	o.channel = relaycore.PGChannel(opts.Schema, opts.Table)
	o.lockNS = relaycore.PGKeyLockNS(opts.Schema, opts.Table)
	name := opts.Schema + "." + opts.Table
	o.relayNS = int32(fnvSum32("idem:outbox:relay:"+name) & 0x7fffffff)
	o.sql = buildStatements(o.table)
	return o, nil
}

func fnvSum32(s string) uint32 {
	h := fnv.New32a()
	h.Write([]byte(s))
	return h.Sum32()
}

// Options returns the outbox's options with defaults filled in.
func (o *Outbox) Options() Options { return o.opts }

// Table returns the quoted, schema-qualified table name.
func (o *Outbox) Table() string { return o.table }

// Channel returns the LISTEN/NOTIFY channel Enqueue notifies and the relay
// listens on: "idem_outbox.<schema>.<table>", or a hash of the name when
// that is longer than 63 bytes.
func (o *Outbox) Channel() string { return o.channel }

// Enqueue writes msgs in tx, the caller's transaction: they are published
// after tx commits and never if it rolls back. It returns the messages' ids,
// in order.
//
// Each message gets a time-ordered id (UUIDv7) unless Message.ID is already
// set to a UUID, the trace context of ctx in its headers (see
// Options.Propagator; headers already set win), and its created and
// available times from the database clock. Message.Attempt and CreatedAt
// are ignored. Topic is the Kafka topic or the AMQP exchange (empty: AMQP's
// default exchange, which routes by Key to the queue of that name); Key orders:
// two messages with the same non-empty key are published in commit order,
// and an empty key means "no order". Topic and headers must be valid UTF-8
// without NUL bytes, and each header's name plus value at most 64 KiB.
//
// Commit order. A sequence column numbers the rows, but two transactions can
// commit in another order than they took their numbers. So, for each
// distinct non-empty key, Enqueue takes a transaction-scoped advisory lock
// (pg_advisory_xact_lock on a hash of the table and the key) before
// inserting: a second transaction enqueueing the same key waits at Enqueue
// until the first one commits or rolls back, and then takes a later number.
// For one key, sequence order is therefore commit order. The cost: business
// transactions that enqueue the same key serialize from their Enqueue to
// their commit, so keep them short after Enqueue (or Enqueue last), and
// enqueue a transaction's keys in one call — the keys of one call are locked
// in a fixed order, while two transactions that lock the same keys in
// opposite orders over several calls can deadlock (PostgreSQL aborts one
// with SQLSTATE 40P01, which is safe to retry). Unrelated keys collide on a
// 64-bit hash only. Options.NoKeyLock turns the lock off.
//
// Enqueue also issues pg_notify on Channel, which PostgreSQL delivers at
// commit and folds into one notification per transaction: the relay wakes
// up right after the commit (unless Options.NoNotify).
func (o *Outbox) Enqueue(ctx context.Context, tx pgx.Tx, msgs ...outbox.Message) ([]string, error) {
	if tx == nil {
		return nil, errors.New("pgoutbox: Enqueue: tx is nil; pass the business transaction")
	}
	if len(msgs) == 0 {
		return nil, nil
	}
	n := len(msgs)
	var (
		ids      = make([]string, n)
		topics   = make([]string, n)
		keys     = make([][]byte, n)
		hashes   = make([]int32, n)
		payloads = make([][]byte, n)
		headers  = make([]string, n)
		lockIDs  []int64
	)
	for i := range msgs {
		m := &msgs[i]
		id, err := msgcheck.ID(m.ID)
		if err != nil {
			return nil, fmt.Errorf("pgoutbox: Enqueue: message %d: %w", i, err)
		}
		if err := msgcheck.Topic(m.Topic); err != nil {
			return nil, fmt.Errorf("pgoutbox: Enqueue: message %d (id #%s): %w", i, dedup.HashKey("", id.String()), err)
		}
		h := telemetry.InjectHeaders(ctx, o.opts.Propagator, m.Headers)
		if err := msgcheck.Headers(h); err != nil {
			return nil, fmt.Errorf("pgoutbox: Enqueue: message %d (id #%s): %w", i, dedup.HashKey("", id.String()), err)
		}
		js := []byte("{}")
		if len(h) > 0 {
			if js, err = json.Marshal(h); err != nil {
				return nil, fmt.Errorf("pgoutbox: Enqueue: message %d (id #%s): headers: %w", i, dedup.HashKey("", id.String()), err)
			}
		}
		ids[i] = id.String()
		topics[i] = m.Topic
		keys[i] = m.Key
		if keys[i] == nil {
			keys[i] = []byte{}
		}
		hashes[i] = relaycore.PGKeyHash(m.Key, id)
		payloads[i] = m.Payload
		if payloads[i] == nil {
			payloads[i] = []byte{}
		}
		headers[i] = string(js)
		if len(m.Key) > 0 && !o.opts.NoKeyLock {
			lockIDs = append(lockIDs, relaycore.PGKeyLockID(o.lockNS, m.Key))
		}
	}
	b := &pgx.Batch{}
	if len(lockIDs) > 0 {
		b.Queue(o.sql.lockKeys, lockIDs)
	}
	b.Queue(o.sql.insert, ids, topics, keys, hashes, payloads, headers)
	if !o.opts.NoNotify {
		b.Queue(o.sql.notify, o.channel)
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("pgoutbox: Enqueue into %s: %w", o.table, err)
	}
	return ids, nil
}
