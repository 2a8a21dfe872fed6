package walrelay

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"regexp"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/propagation"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/sqlname"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/internal/msgcheck"
	"github.com/idemkit/idem/outbox/internal/relaycore"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// Source says where the relay reads the outbox messages from. The zero
// Source is SourceMessages.
type Source int

const (
	// SourceTable reads the inserts into the outbox table (the
	// outbox/pgoutbox layout) from a publication on that table. Enqueue
	// inserts one row per message; the rows are deleted by Cleanup after
	// Options.Retention.
	SourceTable Source = iota + 1
	// SourceMessages reads logical decoding messages: Enqueue writes the
	// messages into the write-ahead log with pg_logical_emit_message in
	// the caller's transaction, and no table row at all.
	SourceMessages
)

func (s Source) String() string {
	switch s {
	case SourceTable:
		return "table"
	case SourceMessages:
		return "messages"
	}
	return fmt.Sprintf("Source(%d)", int(s))
}

// MarshalText writes the Source as String does ("messages" or "table"),
// and the zero Source as "".
func (s Source) MarshalText() ([]byte, error) {
	switch s {
	case 0:
		return nil, nil
	case SourceTable, SourceMessages:
		return []byte(s.String()), nil
	}
	return nil, fmt.Errorf("walrelay: unknown %v", s)
}

// UnmarshalText sets the Source named by text ("messages" or "table", as
// String writes them; "" is the zero Source), for command lines
// (flag.TextVar) and configuration files.
func (s *Source) UnmarshalText(text []byte) error {
	switch string(text) {
	case "":
		*s = 0
	case "messages":
		*s = SourceMessages
	case "table":
		*s = SourceTable
	default:
		return fmt.Errorf("walrelay: unknown source %q; use messages or table", text)
	}
	return nil
}

// Options configure an Outbox. The zero value is usable.
type Options struct {
	// Source is where messages are written and read. Defaults to
	// SourceMessages (see the package documentation for why).
	Source Source
	// Schema holds the outbox table (SourceTable), the dead table and the
	// migrations table. Defaults to "public".
	Schema string
	// Table names the outbox: the table read with SourceTable, and the
	// base of the other names (the dead table <Table>_dead, the default
	// Slot, Publication and Prefix) with either source. Defaults to
	// "outbox".
	Table string
	// Prefix is the prefix of the logical decoding messages Enqueue writes
	// and the relay reads (SourceMessages); messages with another prefix
	// are ignored. Defaults to "idem.outbox:<schema>.<table>".
	Prefix string
	// Slot is the name of the logical replication slot. Slots are
	// cluster-wide: two outboxes of one PostgreSQL cluster need two slots,
	// even in different databases. Lowercase letters, digits and
	// underscores, at most 63 bytes. Defaults to
	// "idem_outbox_<schema>_<table>" (a hash when that is too long).
	Slot string
	// Publication is the name of the publication the relay streams: on
	// the outbox table with SourceTable, an empty one with SourceMessages
	// (the pgoutput plugin needs one). Defaults to Slot's name.
	Publication string
	// Propagator adds the trace context of Enqueue's ctx to each message's
	// headers. Defaults to W3C Trace Context (propagation.TraceContext{}):
	// the OpenTelemetry span context of ctx as traceparent and tracestate,
	// whatever the global propagator is. Pass otel.GetTextMapPropagator(),
	// or a composite with propagation.Baggage{}, to carry more, and
	// propagation.NewCompositeTextMapPropagator() to carry nothing.
	Propagator propagation.TextMapPropagator
	// Retention is how long Cleanup keeps the outbox table's rows
	// (SourceTable). The relay reads the write-ahead log, not the table,
	// so a row is kept only for inspection and as a fallback copy (see
	// the package documentation). Defaults to 24 hours.
	Retention time.Duration
	// CleanupBatch is the number of rows one cleanup statement deletes.
	// Defaults to 1000.
	CleanupBatch int
	// Logger receives warnings, and the relays' unless
	// RelayOptions.Logger is set. Message ids are logged only as their
	// hash (dedup.HashKey("", id)). Defaults to slog.Default().
	Logger *slog.Logger
}

// Outbox is an outbox read from PostgreSQL's write-ahead log: Enqueue
// writes messages in the caller's transaction, Migrate sets up the
// publication, the slot and the dead table, and a Relay streams and
// publishes. It is safe for concurrent use.
type Outbox struct {
	pool    *pgxpool.Pool // nil for an Outbox that only enqueues
	opts    Options
	table   *pgoutbox.Outbox // SourceTable: the table's Enqueue and migrations
	tableQ  string           // quoted outbox table
	deadQ   string           // quoted dead table
	verQ    string           // quoted migrations table
	sqlDead string
}

// maxTable bounds Options.Table so that <table>_dead and
// <table>_wal_migrations fit PostgreSQL's 63 bytes.
const maxTable = 48

var slotName = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

// New returns the Outbox named by opts, on pool. It does not touch the
// database: call Migrate once before use (or apply SQL, and create the
// publication and the slot by hand).
//
// pool may be nil for an Outbox that only enqueues (Enqueue runs in the
// caller's transaction); Migrate, Check, Slot, DropSlot, Cleanup,
// RequeueDead and NewRelay need it.
func New(pool *pgxpool.Pool, opts Options) (*Outbox, error) {
	if err := sqlname.SchemaTable("walrelay: Options", &opts.Schema, &opts.Table, "outbox", maxTable); err != nil {
		return nil, err
	}
	switch opts.Source {
	case 0:
		opts.Source = SourceMessages
	case SourceTable, SourceMessages:
	default:
		return nil, fmt.Errorf("walrelay: Options.Source is %v; use SourceTable or SourceMessages", opts.Source)
	}
	name := opts.Schema + "." + opts.Table
	if opts.Prefix == "" {
		opts.Prefix = "idem.outbox:" + name
	}
	if !utf8.ValidString(opts.Prefix) || strings.ContainsRune(opts.Prefix, 0) {
		return nil, fmt.Errorf("walrelay: Options.Prefix %q is not valid UTF-8 text", opts.Prefix)
	}
	if opts.Slot == "" {
		opts.Slot = defaultSlot(opts.Schema, opts.Table)
	}
	if !slotName.MatchString(opts.Slot) {
		return nil, fmt.Errorf("walrelay: Options.Slot %q is not allowed: use 1 to 63 lowercase letters, digits and underscores", opts.Slot)
	}
	if opts.Publication == "" {
		opts.Publication = opts.Slot
	}
	if err := sqlname.Check("walrelay: Options.Publication", opts.Publication); err != nil {
		return nil, err
	}
	if opts.Retention < 0 || (opts.Retention > 0 && opts.Retention < time.Millisecond) {
		return nil, fmt.Errorf("walrelay: Options.Retention is %v; use at least 1ms (zero means the default)", opts.Retention)
	}
	if err := relaycore.FillOutbox("walrelay: Options.", relaycore.OutboxDefaults{
		Retention: &opts.Retention, CleanupBatch: &opts.CleanupBatch, Propagator: &opts.Propagator, Logger: &opts.Logger,
	}); err != nil {
		return nil, err
	}
	o := &Outbox{
		pool:   pool,
		opts:   opts,
		tableQ: sqlname.Qualified(opts.Schema, opts.Table),
		deadQ:  sqlname.Qualified(opts.Schema, opts.Table+"_dead"),
		verQ:   sqlname.Qualified(opts.Schema, opts.Table+"_wal_migrations"),
	}
	o.sqlDead = `INSERT INTO ` + o.deadQ + ` (id, topic, key, payload, headers, created_at, lsn, attempts, last_error)
VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7::pg_lsn, $8, $9)
ON CONFLICT (id) DO UPDATE SET attempts = EXCLUDED.attempts, last_error = EXCLUDED.last_error, dead_at = clock_timestamp()`
	if opts.Source == SourceTable {
		// The write-ahead log gives commit order: the table's per-key
		// lock, which makes its sequence follow commit order for the
		// poll relay, is not needed.
		t, err := pgoutbox.New(pool, pgoutbox.Options{
			Schema: opts.Schema, Table: opts.Table, Propagator: opts.Propagator,
			NoKeyLock: true, Retention: opts.Retention, CleanupBatch: opts.CleanupBatch, Logger: opts.Logger,
		})
		if err != nil {
			return nil, err
		}
		o.table = t
	}
	return o, nil
}

// defaultSlot is idem_outbox_<schema>_<table>, or a hash of the name when
// that is longer than 63 bytes.
func defaultSlot(schema, table string) string {
	s := "idem_outbox_" + schema + "_" + table
	if len(s) <= 63 {
		return s
	}
	h := fnv.New64a()
	h.Write([]byte(schema + "." + table))
	return fmt.Sprintf("idem_outbox_%016x", h.Sum64())
}

// Options returns the outbox's options with defaults filled in.
func (o *Outbox) Options() Options { return o.opts }

// DeadTable returns the quoted, schema-qualified name of the table where
// the relay parks the messages it could not publish.
func (o *Outbox) DeadTable() string { return o.deadQ }

// Enqueue writes msgs in tx, the caller's transaction: they are published
// after tx commits and never if it rolls back. It returns the messages'
// ids, in order; each id is the message id downstream.
//
// Each message gets a time-ordered id (UUIDv7) unless Message.ID is already
// set to a UUID, and the trace context of ctx in its headers (see
// Options.Propagator; headers already set win). Message.Attempt and
// CreatedAt are ignored. Two messages with the same non-empty Key are
// published in commit order (messages of one transaction in the order
// given); an empty Key means "no order". Unlike the poll relay's outbox,
// Enqueue takes no per-key lock: the write-ahead log is in commit order.
//
// With SourceMessages the messages of one call are written as one logical
// decoding message (pg_logical_emit_message(true, Prefix, payload)); the
// transaction writes no table row. Their CreatedAt, as published, is the
// transaction's commit time. With SourceTable one row per message is
// inserted into the outbox table (pgoutbox.Outbox.Enqueue without its
// per-key lock).
func (o *Outbox) Enqueue(ctx context.Context, tx pgx.Tx, msgs ...outbox.Message) ([]string, error) {
	if tx == nil {
		return nil, errors.New("walrelay: Enqueue: tx is nil; pass the business transaction")
	}
	if len(msgs) == 0 {
		return nil, nil
	}
	if o.table != nil {
		return o.table.Enqueue(ctx, tx, msgs...)
	}
	payload, ids, err := o.encode(ctx, msgs)
	if err != nil {
		return nil, err
	}
	if _, err := tx.Exec(ctx, emitSQL, o.opts.Prefix, payload); err != nil {
		return nil, fmt.Errorf("walrelay: Enqueue (logical message %q): %w", o.opts.Prefix, err)
	}
	return ids, nil
}

const emitSQL = "SELECT pg_logical_emit_message(true, $1::text, $2::bytea)"

// errBatchNeedsMessages is returned by QueueEnqueue for an outbox whose
// Source is not SourceMessages.
var errBatchNeedsMessages = errors.New("walrelay: QueueEnqueue needs Source SourceMessages")

// QueueEnqueue is Enqueue for a pgx.Batch the caller sends in its
// transaction (tx.SendBatch): the messages' logical decoding message is
// queued after the batch's statements queued so far, so the business
// statements and the outbox write travel in one round trip. It works with
// SourceMessages only (an error otherwise). The messages are
// written when the batch runs, and published if the transaction that ran
// it commits; an error of the queued statement is the batch's error.
func (o *Outbox) QueueEnqueue(ctx context.Context, b *pgx.Batch, msgs ...outbox.Message) ([]string, error) {
	if o.opts.Source != SourceMessages {
		return nil, errBatchNeedsMessages
	}
	if b == nil {
		return nil, errors.New("walrelay: QueueEnqueue: batch is nil")
	}
	if len(msgs) == 0 {
		return nil, nil
	}
	payload, ids, err := o.encode(ctx, msgs)
	if err != nil {
		return nil, err
	}
	b.Queue(emitSQL, o.opts.Prefix, payload)
	return ids, nil
}

// encode gives each message its id and trace context, checks it, and
// returns the payload of the logical decoding message.
func (o *Outbox) encode(ctx context.Context, msgs []outbox.Message) ([]byte, []string, error) {
	ids := make([]string, len(msgs))
	enc := make([]*outbox.Message, len(msgs))
	for i := range msgs {
		m := msgs[i]
		id, err := msgcheck.ID(m.ID)
		if err != nil {
			return nil, nil, fmt.Errorf("walrelay: Enqueue: message %d: %w", i, err)
		}
		m.ID = id.String()
		m.Headers = telemetry.InjectHeaders(ctx, o.opts.Propagator, m.Headers)
		if err := checkMessage(&m); err != nil {
			return nil, nil, fmt.Errorf("walrelay: Enqueue: message %d (id #%s): %w", i, dedup.HashKey("", m.ID), err)
		}
		ids[i] = m.ID
		enc[i] = &m
	}
	return encodeMessages(enc), ids, nil
}

// checkMessage applies the limits of the outbox table to a message that
// goes into the write-ahead log, so that either source accepts the same
// messages and a parked one fits the dead table.
func checkMessage(m *outbox.Message) error {
	if err := msgcheck.Topic(m.Topic); err != nil {
		return err
	}
	return msgcheck.Headers(m.Headers)
}
