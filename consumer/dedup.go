package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/defaults"
	"github.com/idemkit/idem/internal/leasekeep"
	"github.com/idemkit/idem/internal/telemetry"
)

// DedupOptions configure the Dedup middleware. Only Scope is required.
type DedupOptions struct {
	// Scope names who processes the messages: the consumer group plus the
	// handler name, for example "billing/charge-card". Two handlers of the
	// same message need two scopes, or the second never runs. Required;
	// validated like a key part (at most MaxKeyLen bytes, no control bytes).
	Scope string
	// KeyFunc returns a message's id. Defaults to Message.ID. An empty or
	// malformed id is dead-lettered (OutcomeInvalidKey). An error returned by
	// KeyFunc is classified as usual: wrap it with Permanent (or
	// dedup.ErrInvalidKey) when the message can never have a key.
	//
	// A key derived from topic, partition and offset only catches broker
	// redeliveries, never a producer that publishes twice: prefer a
	// producer-assigned id.
	KeyFunc func(*Message) (string, error)
	// Fingerprint returns the digest of a message's content; the same id
	// with another fingerprint is dead-lettered
	// (OutcomeFingerprintMismatch). Defaults to
	// dedup.FingerprintOf(msg.Payload). Return the zero Fingerprint to
	// disable the check.
	Fingerprint func(*Message) dedup.Fingerprint
	// MaxKeyLen limits scope and id, in bytes. Defaults to
	// dedup.DefaultMaxKeyLen. Match the store's own limit.
	MaxKeyLen int
	// ExtendEvery is how often the lease is extended while the handler
	// runs. Defaults to a third of the lease's TTL (no heartbeat when the
	// store reports no TTL). Negative disables the heartbeat. The first
	// extension comes between ExtendEvery/2 and ExtendEvery after the
	// claim, the later ones every ExtendEvery: one timer per middleware
	// serves all the handlers in flight, so a handler that returns sooner
	// costs no timer at all.
	ExtendEvery time.Duration
	// FinishTimeout bounds Complete and Release. Both run with
	// context.WithoutCancel, so a handler that succeeded just as the
	// consumer stopped is still recorded. Defaults to 10s.
	FinishTimeout time.Duration
	// Telemetry: the middleware's metrics, spans, logs and outcome
	// reports (the block every idem adapter's options embed).
	//
	// Logger receives warnings: failed heartbeats and releases, lost
	// leases. Defaults to discarding them.
	//
	// OnOutcome, if set, is called once per message with its Report
	// (Outcome, Key, Message, Err). It must be fast and safe for
	// concurrent use.
	//
	// MeterProvider receives the metrics idem.claims,
	// idem.claim.duration, idem.handler.duration and idem.lease.lost
	// (README, "Operating idem"). Defaults to otel.GetMeterProvider(),
	// a no-op until the application installs a provider.
	//
	// TracerProvider starts the idem.claim, idem.handle and
	// idem.complete spans, only under a recording span in the message's
	// context (an adapter's consumer span). Defaults to
	// otel.GetTracerProvider().
	Telemetry
	// StoreName is the idem.store metric attribute. Defaults to the
	// store's package name: memstore, pgtable, redisnx, twolevel.
	StoreName string
}

// Dedup returns middleware that runs the handler at most once per key at a
// time and never again once it succeeded, using a lease from store. It is
// for effects outside the database (an email, a call to a payment
// provider); for effects in the database use Transactional, which is exact.
//
// For each message Dedup builds the key (Scope, KeyFunc, Fingerprint) and
// claims it:
//
//   - duplicate, in flight, fingerprint mismatch, invalid key, or any store
//     error: the handler does not run and the claim's error is returned
//     (wrapped; errors.Is/As and dedup.StoredResult see through). A store
//     error is transient: when the store is down nothing runs (fail closed).
//   - lease granted: a heartbeat extends it every ExtendEvery while the
//     handler runs. If the store answers dedup.ErrLeaseLost, the handler's
//     context is cancelled with that cause (context.Cause) and Dedup
//     returns an error wrapping dedup.ErrLeaseLost (retried).
//   - the handler fails: the lease is released so the redelivery runs the
//     handler again, and the handler's error is returned unchanged. If the
//     release fails it is logged; the lease then expires on its own.
//   - the handler panics: the lease is released and the panic goes on (put
//     Recover outside Dedup).
//   - the handler succeeds: the key is completed with the result the
//     handler passed to SetResult. If that fails, an error wrapping the
//     store's is returned and the message is not acknowledged; the
//     redelivery waits for the lease to expire and runs the handler again.
//     That window, like a crash between the effect and Complete, is why a
//     lease gives at-least-once effects with duplicates made rare, not
//     exactly-once ones: an effect outside the database cannot commit
//     together with the mark.
//
// The heartbeat goroutine is stopped and joined before Dedup returns, on
// every path.
func Dedup(store dedup.LeaseStore, opts DedupOptions) (Middleware, error) {
	if store == nil {
		return nil, errors.New("consumer: Dedup: store is nil; pass a dedup.LeaseStore such as memstore.New or redisnx.New")
	}
	kb, err := newKeyBuilder("Dedup", opts.Scope, opts.KeyFunc, opts.Fingerprint, opts.MaxKeyLen)
	if err != nil {
		return nil, err
	}
	c := defaults.New("consumer: Dedup: DedupOptions")
	c.Duration("FinishTimeout", &opts.FinishTimeout, 10*time.Second)
	if err := c.Err(); err != nil {
		return nil, err
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.StoreName == "" {
		opts.StoreName = telemetry.StoreName(store)
	}
	d := &dedupMiddleware{store: store, keys: kb, opts: opts,
		tel:    telemetry.NewDedup(opts.MeterProvider, opts.TracerProvider, opts.Scope, opts.StoreName),
		keeper: leasekeep.New(store, opts.Logger, "consumer")}
	return func(next Handler) Handler {
		return HandlerFunc(func(ctx context.Context, msg *Message) error {
			return d.handle(ctx, msg, next)
		})
	}, nil
}

type dedupMiddleware struct {
	store  dedup.LeaseStore
	keys   *keyBuilder
	opts   DedupOptions
	tel    *telemetry.Dedup
	keeper *leasekeep.Keeper
}

func (d *dedupMiddleware) outcome(ctx context.Context, msg *Message, key dedup.Key, o Outcome, err error) {
	report(ctx, d.opts.OnOutcome, Report{Outcome: o, Key: key, Message: msg, Err: err})
}

// dedupRun is one message's state under a claim, allocated once: the lease
// flow (the handler's context, the heartbeat, Complete or Release) and the
// result slot.
type dedupRun struct {
	leasekeep.Run
	slot resultSlot
	hctx slotCtx
}

// slotCtx is the handler's context: its parent with the result slot as the
// value of resultKey (context.WithValue, without an allocation of its own),
// and with the delivery's handler slot (Message.Slot) hidden.
type slotCtx struct {
	context.Context
	slot *resultSlot
}

func (c *slotCtx) Value(key any) any {
	switch key.(type) {
	case resultKey:
		return c.slot
	case slotHiddenKey:
		// The delivery's handler slot is this Dedup's to give away and
		// take back: a Dedup inside the handler (in goroutines, say)
		// must not move it.
		return true
	}
	return c.Context.Value(key)
}

// handlerSlot is the type of Message.Slot.
type handlerSlot = interface {
	Away()
	Back(ctx context.Context) error
}

// slotHiddenKey marks a context whose handler slot belongs to a Dedup or a
// Transactional further out: the value is true.
type slotHiddenKey struct{}

// slotOf is msg's handler slot, unless a Dedup or Transactional further out
// owns it (ctx says so), or there is none.
func slotOf(ctx context.Context, msg *Message) handlerSlot {
	if msg.Slot == nil || ctx.Value(slotHiddenKey{}) != nil {
		return nil
	}
	return msg.Slot
}

// hideSlot returns ctx marked so that a Dedup under it leaves msg's handler
// slot alone (see slotOf).
func hideSlot(ctx context.Context, msg *Message) context.Context {
	if msg.Slot == nil {
		return ctx
	}
	return context.WithValue(ctx, slotHiddenKey{}, true)
}

func (d *dedupMiddleware) handle(ctx context.Context, msg *Message, next Handler) error {
	key, err := d.keys.build(msg)
	if err != nil {
		d.outcome(ctx, msg, dedup.Key{}, OutcomeInvalidKey, err)
		d.tel.Claimed(ctx, telemetry.ClaimInvalidKey, 0)
		return err
	}
	// The clock is read only for the duration histograms, when a meter
	// provider records them; span attributes are built only under a
	// recording span (a variadic call through a func value would allocate
	// them every time).
	m := dedupCall{msg: msg, key: key, st: slotOf(ctx, msg), timed: d.tel.Timed(ctx), recording: telemetry.Recording(ctx)}
	lease, err := d.claim(ctx, &m)
	if err != nil {
		return err
	}
	return d.run(ctx, &m, lease, next)
}

// dedupCall is what handle knows of one message on its way through Dedup.
type dedupCall struct {
	msg           *Message
	key           dedup.Key
	st            handlerSlot // nil: no handler slot to give up
	timed         bool        // record durations
	recording     bool        // under a recording span
	start, hstart time.Time   // when the claim and the handler started, when timed
}

// claim claims m's key. The claim's round trip need not hold a handler slot
// (Message.Slot): another delivery's handler may run meanwhile.
func (d *dedupMiddleware) claim(ctx context.Context, m *dedupCall) (*dedup.Lease, error) {
	if m.timed {
		m.start = time.Now()
	}
	cctx, endClaim := ctx, noEnd
	if m.recording {
		cctx, endClaim = telemetry.StartSpan(ctx, d.tel.Tracer, "idem.claim", d.tel.SpanAttrs(m.key.Hash())...)
	}
	if m.st != nil {
		m.st.Away()
	}
	lease, err := d.store.Claim(cctx, m.key)
	if err == nil && lease == nil {
		err = errors.New("the store returned neither a lease nor an error")
	}
	if err != nil {
		d.tel.Claimed(ctx, telemetry.ClaimOutcome(err), since(m.timed, m.start))
		if m.recording {
			endClaim(telemetry.SpanErr(err), telemetry.AttrOutcome.String(telemetry.ClaimOutcome(err)))
		}
		d.outcome(ctx, m.msg, m.key, claimOutcome(err), err)
		return nil, fmt.Errorf("consumer: claim %s: %w", m.key, err)
	}
	if m.timed {
		m.hstart = time.Now()
	}
	d.tel.Claimed(ctx, telemetry.ClaimFirst, m.hstart.Sub(m.start))
	if m.recording {
		endClaim(nil, telemetry.AttrOutcome.String(telemetry.ClaimFirst))
	}
	return lease, nil
}

// run runs next under lease: the heartbeat, the wait for the handler slot,
// the handler, then Complete or Release.
func (d *dedupMiddleware) run(ctx context.Context, m *dedupCall, lease *dedup.Lease, next Handler) error {
	msg, key, st := m.msg, m.key, m.st
	run := &dedupRun{}
	every := d.opts.ExtendEvery
	if every == 0 {
		every = lease.TTL / 3
	}
	// The heartbeat lives as long as the handler runs, not as long as ctx:
	// a handler that finishes its work during a graceful stop keeps its
	// lease. It starts before the wait for a handler slot, which may be
	// long when every handler is busy.
	d.keeper.Begin(ctx, nil, &run.Run, lease, every, d.opts.FinishTimeout)
	defer run.End()
	run.hctx = slotCtx{Context: &run.Ctx, slot: &run.slot}
	var hctx context.Context = &run.hctx
	if err := d.slotBack(&run.Ctx, st, lease, every); err != nil {
		// The lease was lost, the consumer stops, or the handler context
		// ended, while this delivery waited for a handler slot: the
		// handler never ran.
		if lost := run.Stop(); lost != nil {
			d.tel.LeaseLost(ctx)
			d.outcome(ctx, msg, key, OutcomeLeaseLost, lost)
			return fmt.Errorf("consumer: lease of %s lost while waiting for a handler slot: %w", key, lost)
		}
		run.Release("the handler was not started: " + err.Error())
		d.outcome(ctx, msg, key, OutcomeReleased, err)
		return fmt.Errorf("consumer: waiting for a handler slot for %s: %w", key, err)
	}
	if m.timed && st != nil {
		m.hstart = time.Now() // the handler's duration leaves the wait out
	}
	endHandle := noEnd
	if m.recording {
		hctx, endHandle = telemetry.StartSpan(hctx, d.tel.Tracer, "idem.handle")
	}
	end := func(outcome string, err error) {
		d.tel.Handled(ctx, outcome, since(m.timed, m.hstart))
		d.outcome(ctx, msg, key, Outcome(outcome), err)
	}

	returned := false
	defer func() {
		if !returned {
			// The handler panicked (or called runtime.Goexit). Give the
			// key back so a redelivery can run; the panic goes on to
			// Recover.
			endHandle(leasekeep.ErrPanicked)
			end(run.Abandon(), leasekeep.ErrPanicked)
		}
	}()
	herr := next.Handle(hctx, msg)
	returned = true
	endHandle(herr)
	if st != nil {
		st.Away() // Complete or Release need no handler slot either
	}
	var tracer trace.Tracer
	if m.recording {
		tracer = d.tel.Tracer
	}
	o, err := run.Settle(herr, run.slot.get(), tracer)
	end(o, err)
	return err
}

// errSlotWait is the error of a delivery whose lease has no heartbeat and
// that waited half of it for a handler slot.
var errSlotWait = errors.New("no handler slot was free within half of the lease, which has no heartbeat")

// slotBack takes the delivery's handler slot back after the claim (see
// Message.Slot). Without a heartbeat nothing extends the lease while the
// delivery waits: the wait is then bounded by half of the lease, so that
// the handler never starts on a lease about to run out.
func (d *dedupMiddleware) slotBack(ctx context.Context, st handlerSlot, lease *dedup.Lease, every time.Duration) error {
	if st == nil {
		return nil
	}
	if every > 0 || lease.TTL <= 0 {
		return st.Back(ctx)
	}
	wctx, cancel := context.WithTimeoutCause(ctx, lease.TTL/2, errSlotWait)
	defer cancel()
	return st.Back(wctx)
}

// since is the time since start, when timed.
func since(timed bool, start time.Time) time.Duration {
	if !timed {
		return 0
	}
	return time.Since(start)
}

// noEnd ends no span.
func noEnd(error, ...attribute.KeyValue) {}
