package walrelay

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/internal/relaycore"
)

// RelayOptions configure a Relay. The zero value is usable.
type RelayOptions struct {
	// BatchSize is the most messages one Publish call takes. Defaults to
	// 500.
	BatchSize int
	// PerKeyBatch is the most messages of one key a batch takes. Defaults
	// to 1: a key's next message is sent only after the previous one was
	// confirmed, so a failure of the earlier one can never let a later
	// one through. A larger value raises the throughput of a hot key; when
	// the broker then rejects an earlier message of a key and confirms a
	// later one of the same batch, the later one is out before the
	// earlier one's retry.
	PerKeyBatch int
	// PublishesInFlight is the most Publish calls the relay has waiting
	// for the broker at once. Defaults to 1. A second call lets the relay
	// send the next batch while the broker confirms one (the confirm wait
	// of RabbitMQ's publisher confirms, for instance), which raises the
	// rate a relay keeps up with; a key's next message still waits for
	// the outcome of the one in flight, so order per key is unchanged.
	// More than 1 calls Publish from several goroutines at once: use it
	// only with a Publisher that is safe for concurrent use (the
	// adapters/amqp and adapters/kafka publishers are). At most 64.
	PublishesInFlight int
	// MaxInFlight is the most messages the relay holds received and not
	// yet published (or parked); past it, it stops reading the stream
	// until some are done. It bounds the relay's memory. Defaults to
	// 10000.
	MaxInFlight int
	// MaxAttempts is the number of failed publish attempts after which a
	// message is parked in the dead table. Only per-message failures count
	// (an *outbox.PublishError naming the message); an error for the whole
	// batch (the broker unreachable) counts no attempt. Defaults to 10.
	MaxAttempts int
	// Backoff spaces the attempts of a failed message: after its n-th
	// failed attempt it waits Backoff.Delay(n), spread ±20%. Initial must
	// be at least 1ms. Defaults to Initial 1s, Max 1m, Factor 2: with the
	// default MaxAttempts a message that always fails is parked after
	// about 4.5 minutes. The slot's position cannot pass a message until
	// it is published or parked, so this is also the longest a poison
	// message delays the confirmation of the others (they are published
	// meanwhile).
	Backoff consumer.Backoff
	// ReconnectBackoff spaces the relay's reconnects after it lost its
	// replication connection, and its retries of a batch whose Publish
	// failed as a whole: Initial, growing by Factor up to Max, each spread
	// ±20%, and Initial again after a success. Defaults to Initial 100ms,
	// Max 10s, Factor 2.
	ReconnectBackoff consumer.Backoff
	// TakeoverInterval is how often a relay whose slot another relay
	// streams tries again to stream it: the longest a standby relay takes
	// to notice that the active one is gone. Defaults to 1s.
	TakeoverInterval time.Duration
	// StatusInterval is how often the relay reports its confirmed position
	// to the server (a standby status update); the slot's confirmed
	// position trails the broker's confirmations by up to this long, and
	// a crash re-publishes what was confirmed in that time. Defaults to
	// 1s.
	StatusInterval time.Duration
	// CleanupInterval is how often the relay runs Outbox.Cleanup
	// (SourceTable). Negative disables it. Defaults to 1 minute.
	CleanupInterval time.Duration
	// LagWarnBytes is the WAL kept for the slot (idem.outbox.slot.retained)
	// past which the relay logs a warning at each sample. Defaults to
	// 1 GiB.
	LagWarnBytes int64
	// Telemetry: the relay's metrics, spans and logs (consumer's block,
	// shared by every adapter and relay).
	//
	// MeterProvider receives the relay's OpenTelemetry metrics: the
	// outbox counters and histograms of the poll relay
	// (idem.outbox.published, .retried, .dead, .publish.duration,
	// .delay), and the slot gauges idem.outbox.slot.lag and .retained
	// (sampled every MetricsInterval) and idem.outbox.slot.lag_age.
	// Defaults to otel.GetMeterProvider().
	//
	// TracerProvider starts a producer span per published batch, linked
	// to the trace context each message carries from Enqueue. Defaults to
	// otel.GetTracerProvider().
	//
	// Logger receives warnings (connection lost, publish failures,
	// messages parked, the slot's lag). Defaults to the Outbox's logger.
	//
	// OnOutcome must be nil: a relay publishes rows and settles no
	// consumer message, so it has no consumer.Report to give; the counters
	// above count its messages. NewRelay refuses a set OnOutcome.
	consumer.Telemetry
	// MetricsInterval is how often the slot's lag is sampled from the
	// database. Defaults to 15s.
	MetricsInterval time.Duration
	// ShutdownTimeout is how long the batches in flight when Run's
	// context ends may take to finish before the relay reports its
	// position and stops. Defaults to 10s.
	ShutdownTimeout time.Duration
	// QueryTimeout bounds each database round trip other than the
	// stream. Defaults to 30s.
	QueryTimeout time.Duration
	// ConnConfig is what the replication connection connects with (the
	// relay adds replication=database). Replication connections do not
	// go through a pooler that does not pass them on (PgBouncer before
	// 1.23 refuses them): when the Outbox's pool goes through one, set
	// this to a direct connection to the same database, for example
	// &cfg.Config of pgx.ParseConfig of its URL; the relay's other
	// queries keep using the pool. Defaults to the pool's connection
	// settings.
	ConnConfig *pgconn.Config
}

func (o *RelayOptions) fill(ob *Outbox) error {
	const prefix = "walrelay: RelayOptions."
	err := relaycore.FillInts(prefix,
		relaycore.Int{Name: "BatchSize", V: &o.BatchSize, Def: 500, Max: 10000},
		relaycore.Int{Name: "PerKeyBatch", V: &o.PerKeyBatch, Def: 1, Max: 10000},
		relaycore.Int{Name: "MaxInFlight", V: &o.MaxInFlight, Def: 10000, Max: 1 << 24},
		relaycore.Int{Name: "PublishesInFlight", V: &o.PublishesInFlight, Def: 1, Max: 64},
		relaycore.Int{Name: "MaxAttempts", V: &o.MaxAttempts, Def: 10, Max: 1 << 20})
	if err != nil {
		return err
	}
	if o.MaxInFlight < o.BatchSize {
		return fmt.Errorf("walrelay: RelayOptions.MaxInFlight %d is smaller than BatchSize %d", o.MaxInFlight, o.BatchSize)
	}
	err = relaycore.FillDurations(prefix,
		relaycore.Duration{Name: "TakeoverInterval", V: &o.TakeoverInterval, Def: time.Second},
		relaycore.Duration{Name: "StatusInterval", V: &o.StatusInterval, Def: time.Second},
		relaycore.Duration{Name: "MetricsInterval", V: &o.MetricsInterval, Def: 15 * time.Second},
		relaycore.Duration{Name: "ShutdownTimeout", V: &o.ShutdownTimeout, Def: 10 * time.Second},
		relaycore.Duration{Name: "QueryTimeout", V: &o.QueryTimeout, Def: 30 * time.Second})
	if err != nil {
		return err
	}
	err = relaycore.FillCommon(prefix, relaycore.Common{
		Backoff: &o.Backoff, BackoffDef: consumer.Backoff{Initial: time.Second, Max: time.Minute, Factor: 2},
		ReconnectBackoff: &o.ReconnectBackoff, CleanupInterval: &o.CleanupInterval, Telemetry: &o.Telemetry,
	}, ob.opts.Logger)
	if err != nil {
		return err
	}
	if o.LagWarnBytes < 0 {
		return fmt.Errorf("walrelay: RelayOptions.LagWarnBytes is %d; it must not be negative", o.LagWarnBytes)
	}
	if o.LagWarnBytes == 0 {
		o.LagWarnBytes = 1 << 30
	}
	return nil
}

// Relay streams an Outbox's messages from its replication slot and
// publishes them through a Publisher. Run one or more per outbox: one
// streams the slot, the others wait and take over when it stops or dies.
type Relay struct {
	ob      *Outbox
	pub     outbox.Publisher
	opts    RelayOptions
	connCfg *pgconn.Config
	running atomic.Bool
	tel     *relayTelemetry
	hooks   hooks
}

// hooks are test seams (set through export_test.go).
type hooks struct {
	// streaming runs when the relay starts streaming the slot.
	streaming func()
	// slotBusy runs when the relay found the slot streamed by another.
	slotBusy func()
	// beforeCommit runs in the reader after it handed a transaction's
	// messages to the engine and before it hands the commit (not for a
	// transaction with none of the relay's messages, such as another
	// outbox's on the same database).
	beforeCommit func()
	// afterPublish runs after Publish returned, before the results are
	// recorded and the position confirmed.
	afterPublish func(msgs []*outbox.Message, err error)
}

// errFatal marks errors that stop Run: misconfiguration, not outages.
var errFatal = errors.New("walrelay: relay cannot run")

// NewRelay returns a relay for ob that publishes through pub. It does not
// touch the database or the broker.
func NewRelay(ob *Outbox, pub outbox.Publisher, opts RelayOptions) (*Relay, error) {
	if ob == nil || ob.pool == nil {
		return nil, errors.New("walrelay: NewRelay: outbox is nil or has no pool; create it with New(pool, ...)")
	}
	if pub == nil {
		return nil, errors.New("walrelay: NewRelay: publisher is nil; pass an outbox.Publisher such as adapters/amqp's or adapters/kafka's")
	}
	if err := opts.fill(ob); err != nil {
		return nil, err
	}
	cfg := ob.pool.Config().ConnConfig.Config.Copy()
	if opts.ConnConfig != nil {
		cfg = opts.ConnConfig.Copy()
	}
	return &Relay{ob: ob, pub: pub, opts: opts, connCfg: cfg,
		tel: newRelayTelemetry(opts.MeterProvider, opts.TracerProvider, ob.opts.Schema+"."+ob.opts.Table, ob.opts.Slot)}, nil
}

// Options returns the relay's options with defaults filled in.
func (r *Relay) Options() RelayOptions { return r.opts }

// Run streams and publishes until ctx ends, then lets the batches in
// flight finish (RelayOptions.ShutdownTimeout), reports the confirmed position to
// the server, stops every goroutine it started and returns nil. It
// returns an error without waiting for ctx when the relay cannot work at
// all (the publication is missing: run Migrate; the slot was invalidated;
// the server is not set up for logical replication), and when called while
// already running.
//
// Run opens a replication connection (replication=database) with the
// pool's connection settings, creates the slot if it does not exist yet
// (a slot created now starts at the current end of the WAL), and streams
// it. When another relay streams the slot, Run waits, trying again every
// TakeoverInterval, and takes over once the other one is gone. Every
// outage is retried with backoff, never returned: the database unreachable,
// the connection killed, the broker down. After a reconnect the server
// sends again everything after the confirmed position: the messages that
// were in flight are published again with the same ids.
//
// The replication connection (RelayOptions.ConnConfig, by default the
// pool's settings) must reach PostgreSQL itself, or a pooler that passes
// replication connections on; the relay's other queries (the slot's lag,
// parking, Cleanup) use the pool. A pooler that refuses the replication
// connection (PgBouncer before 1.23: "unsupported startup parameter:
// replication") makes Run return an error that says to set
// RelayOptions.ConnConfig to a direct connection.
func (r *Relay) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("walrelay: Relay.Run called while the relay is running")
	}
	defer r.running.Store(false)
	unregister := r.tel.register()
	defer unregister()

	loops := []func(context.Context, context.CancelCauseFunc){
		r.streamLoop,
		func(ctx context.Context, _ context.CancelCauseFunc) { r.sampleLoop(ctx) },
	}
	if r.ob.table != nil && r.opts.CleanupInterval > 0 {
		loops = append(loops, func(ctx context.Context, _ context.CancelCauseFunc) {
			_ = relaycore.CleanupLoop(ctx, r.opts.CleanupInterval, r.ob.Cleanup, r.opts.Logger, "walrelay: ", r.ob.tableQ)
		})
	}
	return relaycore.Run(ctx, errFatal, loops...)
}

// streamLoop runs streaming sessions, reconnecting with backoff and
// waiting while another relay holds the slot, until ctx ends.
func (r *Relay) streamLoop(ctx context.Context, stop context.CancelCauseFunc) {
	bo := relaycore.Growing(r.opts.ReconnectBackoff)
	waiting := false
	for ctx.Err() == nil {
		s := newSession(r)
		err := s.run(ctx)
		if ctx.Err() != nil {
			return
		}
		var busy *slotBusyError
		switch {
		case errors.Is(err, errFatal):
			r.opts.Logger.Error("walrelay: relay stopped", "slot", r.ob.opts.Slot, "err", err)
			stop(err)
			return
		case errors.As(err, &busy):
			if h := r.hooks.slotBusy; h != nil {
				h()
			}
			if !waiting {
				r.opts.Logger.Info("walrelay: another relay streams the slot; waiting to take over", "slot", r.ob.opts.Slot, "detail", busy.msg)
				waiting = true
			}
			bo.Reset()
			if !backoff.Sleep(ctx, backoff.Spread(r.opts.TakeoverInterval)) {
				return
			}
			continue
		}
		waiting = false
		if s.streamed {
			bo.Reset()
		}
		d := bo.Next()
		r.opts.Logger.Warn("walrelay: replication stream lost; reconnecting", "slot", r.ob.opts.Slot, "in", d, "err", err)
		if !backoff.Sleep(ctx, d) {
			return
		}
	}
}

// sampleLoop samples the slot's lag every MetricsInterval and warns past
// LagWarnBytes.
func (r *Relay) sampleLoop(ctx context.Context) {
	t := time.NewTicker(r.opts.MetricsInterval)
	defer t.Stop()
	for {
		qctx, cancel := context.WithTimeout(ctx, r.opts.QueryTimeout)
		s, err := r.ob.Slot(qctx)
		cancel()
		switch {
		case err == nil:
			r.tel.lagBytes.Store(s.LagBytes)
			r.tel.retainedBytes.Store(s.RetainedBytes)
			if s.RetainedBytes > r.opts.LagWarnBytes {
				r.opts.Logger.Warn("walrelay: PostgreSQL keeps much WAL for the relay's slot; is the relay running and the broker up?",
					"slot", s.Name, "retained_bytes", s.RetainedBytes, "lag_bytes", s.LagBytes, "active", s.Active, "wal_status", s.WALStatus)
			}
			if s.WALStatus == "lost" {
				r.opts.Logger.Error("walrelay: the relay's slot was invalidated (max_slot_wal_keep_size): it cannot stream again; see the walrelay package documentation", "slot", s.Name)
			}
		case errors.Is(err, ErrNoSlot), ctx.Err() != nil:
		default:
			r.opts.Logger.Warn("walrelay: slot sample failed", "slot", r.ob.opts.Slot, "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
