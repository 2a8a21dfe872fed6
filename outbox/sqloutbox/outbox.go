package sqloutbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"slices"
	"strings"
	"time"

	"go.opentelemetry.io/otel/propagation"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/sqldialect"
	"github.com/idemkit/idem/internal/sqlname"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/internal/msgcheck"
	"github.com/idemkit/idem/outbox/internal/relaycore"
)

// Dialect is the SQL server family behind the *sql.DB.
type Dialect = sqldialect.Dialect

// The dialects of New.
const (
	// Postgres is PostgreSQL through database/sql (pgx's stdlib driver or
	// lib/pq). The table has outbox/pgoutbox's layout; publish it with
	// pgoutbox's Relay.
	Postgres = sqldialect.Postgres
	// MySQL is MySQL 8 or MariaDB 10.6 and later (go-sql-driver/mysql).
	MySQL = sqldialect.MySQL
	// SQLite is SQLite 3.42 or later (modernc.org/sqlite, or another
	// driver).
	SQLite = sqldialect.SQLite
)

// keySlots is the number of rows of the MySQL keys table (see the
// migration): Enqueue locks the slot of each key it writes.
const keySlots = 4096

// insertChunk bounds the rows of one INSERT statement (MySQL allows 65535
// placeholders per statement, PostgreSQL as many).
const insertChunk = 1000

// Options configure an Outbox. The zero value is usable.
type Options struct {
	// Schema holds the table on PostgreSQL. Defaults to "public". On MySQL
	// and SQLite the table lives in the connection's database and Schema
	// must be empty.
	Schema string
	// Table is the table name. Defaults to "outbox". On MySQL a second
	// table, <Table>_keys, holds the key slots Enqueue locks, and on every
	// dialect <Table>_migrations records the applied migrations.
	Table string
	// Propagator adds the trace context of Enqueue's ctx to each message's
	// headers. Defaults to W3C Trace Context (propagation.TraceContext{}):
	// the OpenTelemetry span context of ctx as traceparent and tracestate.
	// Pass propagation.NewCompositeTextMapPropagator() to carry nothing.
	Propagator propagation.TextMapPropagator
	// NoKeyLock disables the per-key lock Enqueue takes on PostgreSQL and
	// MySQL (see Enqueue). Messages of one key are then ordered by the
	// order in which their rows were inserted, not committed. Defaults to
	// false (ordered by commit).
	NoKeyLock bool
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

// Outbox is an outbox table reached through database/sql: Enqueue writes to
// it in the caller's transaction, a Relay publishes from it. It is safe for
// concurrent use.
type Outbox struct {
	db      *sql.DB // nil for an Outbox that only enqueues
	dialect Dialect
	opts    Options
	table   string // quoted (schema-qualified on PostgreSQL)
	channel string // PostgreSQL: pgoutbox's LISTEN/NOTIFY channel
	lockNS  int64  // PostgreSQL: pgoutbox's advisory lock namespace of the keys
	sql     statements

	afterCleanupBatch func(n int64) // test seam
}

// New returns the Outbox of the table named by opts, on db, which speaks
// dialect. It does not touch the database; call Migrate (or apply SQL) once
// before use.
//
// db may be nil for an Outbox that only enqueues (Enqueue runs in the
// caller's transaction) or prints its SQL; Migrate, MigrationStatus,
// Cleanup, Backlog, RequeueDead and NewRelay need it.
func New(db *sql.DB, dialect Dialect, opts Options) (*Outbox, error) {
	if !dialect.Valid() {
		return nil, fmt.Errorf("sqloutbox: New: dialect %v is not supported: pass sqloutbox.Postgres, sqloutbox.MySQL or sqloutbox.SQLite", dialect)
	}
	if dialect != Postgres && opts.Schema != "" {
		return nil, fmt.Errorf("sqloutbox: Options.Schema is %q; on %v the table lives in the connection's database: leave Schema empty", opts.Schema, dialect)
	}
	schema := opts.Schema
	if err := sqlname.SchemaTable("sqloutbox: Options", &schema, &opts.Table, "outbox", 50); err != nil {
		return nil, err
	}
	if dialect == Postgres {
		opts.Schema = schema
	}
	if err := relaycore.CheckRetentions("sqloutbox: Options.",
		relaycore.Duration{Name: "Retention", V: &opts.Retention},
		relaycore.Duration{Name: "DeadRetention", V: &opts.DeadRetention}); err != nil {
		return nil, err
	}
	if err := relaycore.FillOutbox("sqloutbox: Options.", relaycore.OutboxDefaults{
		Retention: &opts.Retention, CleanupBatch: &opts.CleanupBatch, Propagator: &opts.Propagator, Logger: &opts.Logger,
	}); err != nil {
		return nil, err
	}
	o := &Outbox{db: db, dialect: dialect, opts: opts}
	if dialect == Postgres {
		o.table = sqlname.Qualified(opts.Schema, opts.Table)
		// The channel and lock namespace are pgoutbox's, so that
		// pgoutbox's relay wakes up on these rows and orders them
		// with the ones pgoutbox.Enqueue writes.
		o.channel = relaycore.PGChannel(opts.Schema, opts.Table)
		o.lockNS = relaycore.PGKeyLockNS(opts.Schema, opts.Table)
	} else {
		o.table = dialect.Quote(opts.Table)
	}
	o.sql = buildStatements(dialect, o.table, dialect.Quote(opts.Table+"_keys"))
	return o, nil
}

// Options returns the outbox's options with defaults filled in.
func (o *Outbox) Options() Options { return o.opts }

// Dialect returns the dialect given to New.
func (o *Outbox) Dialect() Dialect { return o.dialect }

// Table returns the quoted table name (schema-qualified on PostgreSQL).
func (o *Outbox) Table() string { return o.table }

// keyHash is the key_hash column on MySQL and SQLite: 0 for no key, a
// positive 63-bit hash otherwise.
func keyHash(key []byte) int64 {
	if len(key) == 0 {
		return 0
	}
	h := fnv.New64a()
	h.Write(key)
	return int64(h.Sum64()&0x7fffffffffffffff) | 1
}

// keySlot is the MySQL key slot of a key.
func keySlot(key []byte) int64 {
	h := fnv.New64a()
	h.Write([]byte("idem:outbox:slot\x00"))
	h.Write(key)
	return int64(h.Sum64() % keySlots)
}

// Enqueue writes msgs in tx, the caller's transaction: they are published
// after tx commits and never if it rolls back. It returns the messages' ids,
// in order.
//
// Each message gets a time-ordered id (UUIDv7) unless Message.ID is already
// set to a UUID, the trace context of ctx in its headers (see
// Options.Propagator; headers already set win), and its created and
// available times from the database clock. Message.Attempt and CreatedAt
// are ignored. Topic is the Kafka topic or the AMQP exchange; Key orders:
// two messages with the same non-empty key are published in commit order,
// and an empty key means "no order". Topic and headers must be valid UTF-8
// without NUL bytes, and each header's name plus value at most 64 KiB.
//
// Commit order. The seq column numbers the rows, but two transactions can
// commit in another order than they took their numbers. So, for each
// distinct non-empty key, Enqueue first takes a lock that lasts until tx
// ends: on PostgreSQL pgoutbox's transaction-scoped advisory lock on a hash
// of the table and the key, on MySQL a row lock (SELECT ... FOR UPDATE) on
// the key's slot in <Table>_keys (4096 slots: unrelated keys share a slot
// with a chance of 1 in 4096). A second transaction enqueueing the same key
// waits at Enqueue until the first one ends, and then takes a later number.
// Keep such transactions short after Enqueue, and enqueue a transaction's
// keys in one call: the keys of one call are locked in a fixed order, while
// two transactions that lock the same keys in opposite orders over several
// calls can deadlock (the server aborts one; it is safe to retry). SQLite
// runs one writing transaction at a time, so its rows are in commit order
// without a lock. Options.NoKeyLock turns the lock off.
//
// On PostgreSQL Enqueue also issues pg_notify on pgoutbox's channel, so a
// pgoutbox relay on the same table wakes up right after the commit.
func (o *Outbox) Enqueue(ctx context.Context, tx *sql.Tx, msgs ...outbox.Message) ([]string, error) {
	if tx == nil {
		return nil, errors.New("sqloutbox: Enqueue: tx is nil; pass the business transaction")
	}
	if len(msgs) == 0 {
		return nil, nil
	}
	type row struct {
		id      string
		topic   string
		key     []byte
		pgHash  int32
		hash    int64
		payload []byte
		headers string
	}
	rows := make([]row, len(msgs))
	ids := make([]string, len(msgs))
	var locks []int64
	for i := range msgs {
		m := &msgs[i]
		id, err := msgcheck.ID(m.ID)
		if err != nil {
			return nil, fmt.Errorf("sqloutbox: Enqueue: message %d: %w", i, err)
		}
		if err := msgcheck.Topic(m.Topic); err != nil {
			return nil, fmt.Errorf("sqloutbox: Enqueue: message %d (id #%s): %w", i, dedup.HashKey("", id.String()), err)
		}
		h := telemetry.InjectHeaders(ctx, o.opts.Propagator, m.Headers)
		if err := msgcheck.Headers(h); err != nil {
			return nil, fmt.Errorf("sqloutbox: Enqueue: message %d (id #%s): %w", i, dedup.HashKey("", id.String()), err)
		}
		js := []byte("{}")
		if len(h) > 0 {
			if js, err = json.Marshal(h); err != nil {
				return nil, fmt.Errorf("sqloutbox: Enqueue: message %d (id #%s): headers: %w", i, dedup.HashKey("", id.String()), err)
			}
		}
		r := row{id: id.String(), topic: m.Topic, key: m.Key, payload: m.Payload, headers: string(js)}
		if r.key == nil {
			r.key = []byte{}
		}
		if r.payload == nil {
			r.payload = []byte{}
		}
		r.pgHash = relaycore.PGKeyHash(m.Key, id)
		r.hash = keyHash(m.Key)
		rows[i] = r
		ids[i] = r.id
		if len(m.Key) > 0 && !o.opts.NoKeyLock {
			switch o.dialect {
			case Postgres:
				locks = append(locks, relaycore.PGKeyLockID(o.lockNS, m.Key))
			case MySQL:
				locks = append(locks, keySlot(m.Key))
			}
		}
	}
	if len(locks) > 0 {
		slices.Sort(locks)
		locks = slices.Compact(locks)
		if err := o.lockKeys(ctx, tx, locks); err != nil {
			return nil, fmt.Errorf("sqloutbox: Enqueue into %s: lock keys: %w", o.table, err)
		}
	}
	for start := 0; start < len(rows); start += insertChunk {
		chunk := rows[start:min(start+insertChunk, len(rows))]
		var b strings.Builder
		b.WriteString(o.sql.insertHead)
		args := make([]any, 0, len(chunk)*6)
		for i, r := range chunk {
			if i > 0 {
				b.WriteString(", ")
			}
			b.WriteString(o.sql.insertRow)
			var hash any = r.hash
			if o.dialect == Postgres {
				hash = r.pgHash
			}
			args = append(args, r.id, r.topic, r.key, hash, r.payload, r.headers)
		}
		if _, err := tx.ExecContext(ctx, o.dialect.Rebind(b.String()), args...); err != nil {
			return nil, fmt.Errorf("sqloutbox: Enqueue into %s: %w", o.table, err)
		}
	}
	if o.dialect == Postgres {
		if _, err := tx.ExecContext(ctx, o.sql.notify, o.channel); err != nil {
			return nil, fmt.Errorf("sqloutbox: Enqueue into %s: notify: %w", o.table, err)
		}
	}
	return ids, nil
}

// lockKeys takes the per-key locks, sorted, in one statement.
func (o *Outbox) lockKeys(ctx context.Context, tx *sql.Tx, locks []int64) error {
	args := make([]any, len(locks))
	for i, l := range locks {
		args[i] = l
	}
	marks := strings.TrimSuffix(strings.Repeat("?, ", len(locks)), ", ")
	var q string
	switch o.dialect {
	case Postgres:
		// One row per lock id, in ascending order, each locked in turn.
		q = "SELECT count(pg_advisory_xact_lock(s.k)) FROM (SELECT k FROM unnest(ARRAY[" +
			strings.ReplaceAll(marks, "?", "?::bigint") + "]) AS u(k) ORDER BY 1) s"
	case MySQL:
		q = "SELECT slot FROM " + o.sql.keyTable + " WHERE slot IN (" + marks + ") ORDER BY slot FOR UPDATE"
	default:
		return nil
	}
	rows, err := tx.QueryContext(ctx, o.dialect.Rebind(q), args...)
	if err != nil {
		return err
	}
	n := 0
	for rows.Next() {
		n++
	}
	if err := rows.Err(); err != nil {
		_ = rows.Close()
		return err
	}
	if err := rows.Close(); err != nil {
		return err
	}
	if o.dialect == MySQL && n != len(locks) {
		return fmt.Errorf("%d of %d key slots missing from %s: run Migrate", len(locks)-n, len(locks), o.sql.keyTable)
	}
	return nil
}
