package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/internal/relaycore"
)

// RelayOptions configure a Relay. The zero value is usable.
type RelayOptions struct {
	// Shards is the number of parts the key space is split into; each
	// shard is owned by one relay session at a time. Every relay of one
	// outbox table must use the same value: a relay that sees another
	// relay with a different count owns no shard until that relay is gone
	// (and logs an error). Between 1 and 1024. Defaults to 16.
	Shards int
	// Sessions is the number of dedicated database sessions (claim loops)
	// this relay runs; each one competes for shards like a separate relay.
	// More than one lets one process publish several batches at once, but
	// the relay then calls Publish from several goroutines at once: use it
	// only with a Publisher that is safe for concurrent use (the
	// adapters/amqp and adapters/kafka publishers are). At most Shards.
	// Defaults to 1.
	Sessions int
	// BatchSize is the most messages one claim takes. Defaults to 500.
	BatchSize int
	// PerKeyBatch is the most messages of one key a batch takes. Defaults
	// to 1: a key's next message is sent only after the previous one was
	// confirmed and marked, so a failure of the earlier one can never let
	// a later one through. A larger value raises the throughput of a hot
	// key; the key's messages of one batch are sent in order, but when the
	// broker rejects an earlier one and confirms a later one of the same
	// batch, the later one is out before the earlier one's retry. Use it
	// only where that is acceptable.
	PerKeyBatch int
	// ScanWindow is how many of the oldest claimable rows a claim looks
	// at to pick its batch. A key with more pending rows than this ahead
	// of the others delays them until its backlog drops below it. Defaults
	// to 4 × BatchSize.
	ScanWindow int
	// PollInterval is how often a session looks for work without a
	// notification: the fallback for lost notifications. Defaults to 1s.
	PollInterval time.Duration
	// RebalanceInterval is how often a session recounts the relays and
	// takes or gives back shards. A dead relay's shards are taken over
	// within about this long after its session ends (a relay that joins
	// or stops cleanly is handled at once). Defaults to 1s.
	RebalanceInterval time.Duration
	// MaxAttempts is the number of failed publish attempts after which a
	// message is parked as dead. Only per-message failures count (an
	// *outbox.PublishError naming the message); an error for the whole
	// batch (the broker unreachable) counts no attempt. Defaults to 10.
	MaxAttempts int
	// Backoff spaces the attempts of a failed message: after its n-th
	// failed attempt it waits Backoff.Delay(n), spread ±20%. Initial must
	// be at least 1ms. Defaults to Initial 1s, Max 5m, Factor 2: with the
	// default MaxAttempts a message that always fails is dead after about
	// 8.5 minutes. The consumer's dedup retention must outlive that
	// horizon.
	Backoff consumer.Backoff
	// ReconnectBackoff spaces a session's reconnects to the database and
	// its retries of a batch whose Publish failed as a whole: Initial,
	// growing by Factor up to Max, each spread ±20%, and Initial again
	// after a success. Defaults to Initial 100ms, Max 10s, Factor 2.
	ReconnectBackoff consumer.Backoff
	// DeletePublished deletes a row once its message is confirmed instead
	// of marking it published. Defaults to false (marked, and deleted by
	// Cleanup after Options.Retention).
	DeletePublished bool
	// CleanupInterval is how often the relay runs Outbox.Cleanup.
	// Negative disables it. Defaults to 1 minute.
	CleanupInterval time.Duration
	// Telemetry: the relay's metrics, spans and logs (consumer's block,
	// shared by every adapter and relay).
	//
	// MeterProvider receives the relay's OpenTelemetry metrics (README,
	// "Operating idem"): the counters idem.outbox.published, .retried and
	// .dead (attributes idem.outbox.table, messaging.destination.name =
	// topic), the histograms idem.outbox.publish.duration (one per batch,
	// idem.result ok or error) and idem.outbox.delay (one per published
	// message: from its available time to the broker's confirmation), and
	// the gauges idem.outbox.backlog and idem.outbox.oldest_age, observed
	// when the provider collects and sampled from the database at most
	// about once per MetricsInterval. Defaults to otel.GetMeterProvider(),
	// a no-op until the application installs a provider (with a no-op
	// provider the backlog is never queried).
	//
	// TracerProvider starts a producer span per published batch, "publish
	// <topic>", linked to the trace context each message carries from
	// Enqueue (the messages' headers keep that context). Defaults to
	// otel.GetTracerProvider(), a no-op until the application installs a
	// provider.
	//
	// Logger receives warnings (sessions lost, publish failures, messages
	// parked dead; message ids only as dedup.HashKey("", id)) and debug
	// lines about shards. Defaults to the Outbox's logger
	// (Options.Logger, itself defaulting to slog.Default()).
	//
	// OnOutcome must be nil: a relay publishes rows and settles no
	// consumer message, so it has no consumer.Report to give; the counters
	// above count its messages. NewRelay refuses a set OnOutcome.
	consumer.Telemetry
	// MetricsInterval is the shortest time between two backlog queries
	// for the MeterProvider's gauges (a collection in between reports the
	// last sample). Defaults to 15s.
	MetricsInterval time.Duration
	// ShutdownTimeout is how long the batch in flight when Run's context
	// ends may take to finish (publish and mark). Defaults to 10s.
	ShutdownTimeout time.Duration
	// QueryTimeout bounds each database round trip of a session. Defaults
	// to 30s.
	QueryTimeout time.Duration
	// ConnConfig is what the sessions' dedicated connections connect
	// with. They hold session-level advisory locks (the shards) and
	// LISTEN, so they must reach PostgreSQL itself: a pooler that hands
	// each transaction another server connection (PgBouncer's
	// pool_mode=transaction) keeps neither. When the Outbox's pool goes
	// through such a pooler, set this to a direct connection to the same
	// database, for example pgx.ParseConfig of its URL; Enqueue, Cleanup
	// and the backlog gauges keep using the pool. Run refuses a session
	// connection that goes through a pooler (see SessionPooler). Defaults
	// to the pool's ConnConfig.
	ConnConfig *pgx.ConnConfig
	// SessionPooler accepts session connections that go through a pooler
	// in session mode (PgBouncer's pool_mode=session), which keeps a
	// client on one server connection for as long as it is connected.
	// Run cannot tell that from transaction mode: a pooler of either mode
	// runs the statements on another backend than the one it announced
	// when the connection started, and Run refuses such a connection
	// unless this is set. Defaults to false.
	SessionPooler bool
}

// Relay publishes the committed rows of an Outbox through a Publisher. Run
// it in as many processes as needed: they share the work by shards.
type Relay struct {
	ob      *Outbox
	pub     outbox.Publisher
	opts    RelayOptions
	connCfg *pgx.ConnConfig
	running atomic.Bool
	hooks   hooks
	tel     *relayTelemetry
	backlog backlogCache
}

// hooks are test seams (set through export_test.go).
type hooks struct {
	// afterPublish runs after Publish returned and before the rows are
	// marked.
	afterPublish func(msgs []*outbox.Message, err error)
	// connected runs when a session connected, with its backend pid.
	connected func(pid uint32)
	// idle runs when a session found nothing to do and starts waiting for
	// a notification (or the poll interval, a due retry, a rebalance).
	idle func()
}

// errFatal marks errors that stop Run: misconfiguration, not outages.
var errFatal = errors.New("pgoutbox: relay cannot run")

// NewRelay returns a relay for ob that publishes through pub. It does not
// touch the database or the broker.
func NewRelay(ob *Outbox, pub outbox.Publisher, opts RelayOptions) (*Relay, error) {
	if ob == nil || ob.pool == nil {
		return nil, errors.New("pgoutbox: NewRelay: outbox is nil or has no pool; create it with New")
	}
	if pub == nil {
		return nil, errors.New("pgoutbox: NewRelay: publisher is nil; pass an outbox.Publisher such as adapters/amqp's")
	}
	if err := opts.fill(ob); err != nil {
		return nil, err
	}
	connCfg := ob.pool.Config().ConnConfig
	if opts.ConnConfig != nil {
		connCfg = opts.ConnConfig.Copy()
	}
	return &Relay{ob: ob, pub: pub, opts: opts, connCfg: connCfg,
		tel: newRelayTelemetry(opts.MeterProvider, opts.TracerProvider, ob.opts.Schema+"."+ob.opts.Table)}, nil
}

func (o *RelayOptions) fill(ob *Outbox) error {
	const prefix = "pgoutbox: RelayOptions."
	err := relaycore.FillInts(prefix,
		relaycore.Int{Name: "Shards", V: &o.Shards, Def: 16, Max: 1024},
		relaycore.Int{Name: "BatchSize", V: &o.BatchSize, Def: 500, Max: 10000},
		relaycore.Int{Name: "PerKeyBatch", V: &o.PerKeyBatch, Def: 1, Max: 10000},
		relaycore.Int{Name: "MaxAttempts", V: &o.MaxAttempts, Def: 10, Max: 1 << 20})
	if err != nil {
		return err
	}
	if o.Sessions < 0 || o.Sessions > o.Shards {
		return fmt.Errorf("pgoutbox: RelayOptions.Sessions is %d; use 1 to Shards (%d)", o.Sessions, o.Shards)
	}
	if o.Sessions == 0 {
		o.Sessions = 1
	}
	if o.ScanWindow < 0 {
		return fmt.Errorf("pgoutbox: RelayOptions.ScanWindow is %d; it must not be negative", o.ScanWindow)
	}
	if o.ScanWindow == 0 {
		o.ScanWindow = 4 * o.BatchSize
	}
	if o.ScanWindow < o.BatchSize {
		return fmt.Errorf("pgoutbox: RelayOptions.ScanWindow %d is smaller than BatchSize %d", o.ScanWindow, o.BatchSize)
	}
	err = relaycore.FillDurations(prefix,
		relaycore.Duration{Name: "PollInterval", V: &o.PollInterval, Def: time.Second},
		relaycore.Duration{Name: "RebalanceInterval", V: &o.RebalanceInterval, Def: time.Second},
		relaycore.Duration{Name: "MetricsInterval", V: &o.MetricsInterval, Def: 15 * time.Second},
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

// Run publishes until ctx ends, then lets the batch in flight finish (see
// RelayOptions.ShutdownTimeout), stops every goroutine it started, closes its
// sessions and returns nil. It returns an error without waiting for ctx when
// the relay cannot work at all (the table does not exist: run Migrate), and
// when called while already running.
//
// Each session opens a dedicated connection with RelayOptions.ConnConfig,
// by default the pool's connection settings (not one of the pool's
// connections; the pool's AfterConnect hook does not run on it). On it the session LISTENs on the outbox's channel,
// holds its shards' session-level advisory locks, and runs its claim
// transactions, so a session whose connection drops loses its shards and its
// claims at the same moment. While a full batch awaits the broker, the
// session claims the next batch on a second dedicated connection (opened
// the first time a backlog needs it), starts publishing that batch once the
// broker answered for the first, and marks the first meanwhile: the
// database work of one batch overlaps the broker's work on the other, and at
// most one batch per session awaits the broker. A claim still open on the
// second connection when the first drops ends when the session notices, at
// its next statement, and closes both; until then the rows it holds are
// skipped by other claims like any held row. The session reconnects with
// backoff; the relay's cleanup and backlog sampling use the pool.
//
// Every outage is retried, never returned: the database unreachable, the
// connection killed, the broker down.
//
// The sessions need PostgreSQL sessions of their own: LISTEN and
// session-level advisory locks do not survive a pooler that hands each
// transaction another server connection (PgBouncer's
// pool_mode=transaction). Each session connection is checked before it
// takes any of them: when its statements run on another backend than the
// one announced at its start, a pooler stands between, and Run returns an
// error that says to set RelayOptions.ConnConfig to a direct connection
// (or RelayOptions.SessionPooler, for a pooler in session mode).
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("pgoutbox: Relay.Run called while the relay is running")
	}
	defer r.running.Store(false)
	unregister := r.registerBacklog()
	defer unregister()

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

// sessionLoop runs one session, reconnecting with backoff, until ctx ends.
func (r *Relay) sessionLoop(ctx context.Context, idx int, stop context.CancelCauseFunc) {
	bo := relaycore.Growing(r.opts.ReconnectBackoff)
	for ctx.Err() == nil {
		s := &session{r: r, idx: idx, pubBackoff: relaycore.Growing(r.opts.ReconnectBackoff)}
		err := s.run(ctx)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, errFatal) {
			r.opts.Logger.Error("pgoutbox: relay stopped", "table", r.ob.table, "err", err)
			stop(err)
			return
		}
		if s.worked {
			bo.Reset()
		}
		d := bo.Next()
		r.opts.Logger.Warn("pgoutbox: relay session lost; reconnecting", "table", r.ob.table, "session", idx, "in", d, "err", err)
		if !backoff.Sleep(ctx, d) {
			return
		}
	}
}
