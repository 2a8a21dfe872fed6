package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/dedup"
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
	// malformed id is dead-lettered (ReasonInvalidKey). An error returned by
	// KeyFunc is classified as usual: wrap it with Permanent (or
	// dedup.ErrInvalidKey) when the message can never have a key.
	//
	// A key derived from topic, partition and offset only catches broker
	// redeliveries, never a producer that publishes twice: prefer a
	// producer-assigned id.
	KeyFunc func(*Message) (string, error)
	// Fingerprint returns the digest of a message's content; the same id
	// with another fingerprint is dead-lettered
	// (ReasonFingerprintMismatch). Defaults to
	// dedup.FingerprintOf(msg.Payload). Return the zero Fingerprint to
	// disable the check.
	Fingerprint func(*Message) dedup.Fingerprint
	// MaxKeyLen limits scope and id, in bytes. Defaults to
	// dedup.DefaultMaxKeyLen. Match the store's own limit.
	MaxKeyLen int
	// ExtendEvery is how often the lease is extended while the handler
	// runs. Defaults to a third of the lease's TTL (no heartbeat when the
	// store reports no TTL). Negative disables the heartbeat.
	ExtendEvery time.Duration
	// FinishTimeout bounds Complete and Release. Both run with
	// context.WithoutCancel, so a handler that succeeded just as the
	// consumer stopped is still recorded. Defaults to 10s.
	FinishTimeout time.Duration
	// Logger receives warnings: failed heartbeats and releases, lost
	// leases. Defaults to discarding them.
	Logger *slog.Logger
	// OnOutcome, if set, is called once per message with one of the
	// Outcome constants, for metrics. It must be fast and safe for
	// concurrent use.
	OnOutcome func(ctx context.Context, msg *Message, outcome string)
	// MeterProvider receives the metrics idem.claims,
	// idem.claim.duration, idem.handler.duration and idem.lease.lost
	// (README, "Operating idem"). Defaults to otel.GetMeterProvider(),
	// a no-op until the application installs a provider.
	MeterProvider metric.MeterProvider
	// TracerProvider starts the idem.claim, idem.handle and
	// idem.complete spans, only under a recording span in the message's
	// context (an adapter's consumer span). Defaults to
	// otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
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
	if opts.FinishTimeout < 0 {
		return nil, fmt.Errorf("consumer: Dedup: FinishTimeout is %v; it must be positive (or zero for 10s)", opts.FinishTimeout)
	}
	if opts.FinishTimeout == 0 {
		opts.FinishTimeout = 10 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.StoreName == "" {
		opts.StoreName = telemetry.StoreName(store)
	}
	d := &dedupMiddleware{store: store, keys: kb, opts: opts,
		tel: telemetry.NewDedup(opts.MeterProvider, opts.TracerProvider, opts.Scope, opts.StoreName)}
	return func(next Handler) Handler {
		return HandlerFunc(func(ctx context.Context, msg *Message) error {
			return d.handle(ctx, msg, next)
		})
	}, nil
}

type dedupMiddleware struct {
	store dedup.LeaseStore
	keys  *keyBuilder
	opts  DedupOptions
	tel   *telemetry.Dedup
}

func (d *dedupMiddleware) outcome(ctx context.Context, msg *Message, outcome string) {
	if d.opts.OnOutcome != nil {
		d.opts.OnOutcome(ctx, msg, outcome)
	}
}

func (d *dedupMiddleware) handle(ctx context.Context, msg *Message, next Handler) error {
	key, err := d.keys.build(msg)
	if err != nil {
		d.outcome(ctx, msg, OutcomeInvalidKey)
		d.tel.Claimed(ctx, telemetry.ClaimInvalidKey, 0)
		return err
	}
	start := time.Now()
	// The span's attributes are built only under a recording span: a
	// variadic call through a func value would allocate them every time.
	recording := telemetry.Recording(ctx)
	cctx, endClaim := ctx, noEnd
	if recording {
		cctx, endClaim = telemetry.StartSpan(ctx, d.tel.Tracer, "idem.claim", d.tel.SpanAttrs(key.Hash())...)
	}
	lease, err := d.store.Claim(cctx, key)
	if err == nil && lease == nil {
		err = errors.New("the store returned neither a lease nor an error")
	}
	if err != nil {
		o := claimOutcome(err)
		d.tel.Claimed(ctx, telemetryClaim(o), time.Since(start))
		if recording {
			endClaim(spanErr(err), telemetry.AttrOutcome.String(telemetryClaim(o)))
		}
		d.outcome(ctx, msg, o)
		return fmt.Errorf("consumer: claim %s: %w", key, err)
	}
	hstart := time.Now()
	d.tel.Claimed(ctx, telemetry.ClaimFirst, hstart.Sub(start))
	if recording {
		endClaim(nil, telemetry.AttrOutcome.String(telemetry.ClaimFirst))
	}

	hctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	hctx, slot := withResultSlot(hctx)
	hb := d.startHeartbeat(ctx, lease, cancel)
	hctx, endHandle := telemetry.StartSpan(hctx, d.tel.Tracer, "idem.handle")

	returned := false
	defer func() {
		if returned {
			return
		}
		// The handler panicked (or called runtime.Goexit). Give the key
		// back so a redelivery can run; the panic goes on to Recover.
		endHandle(errors.New("the handler panicked"))
		hb.stop()
		if hb.lostErr != nil {
			d.ended(ctx, msg, hstart, OutcomeLeaseLost)
			return
		}
		d.release(ctx, lease, "the handler panicked")
		d.ended(ctx, msg, hstart, OutcomeReleased)
	}()
	herr := next.Handle(hctx, msg)
	returned = true
	endHandle(herr)
	hb.stop()

	if lost := hb.lostErr; lost != nil {
		d.ended(ctx, msg, hstart, OutcomeLeaseLost)
		if herr != nil {
			return fmt.Errorf("consumer: handler for %s failed after its lease was lost: %w; handler error: %w", key, lost, herr)
		}
		return fmt.Errorf("consumer: handler for %s finished after its lease was lost; it cannot be completed: %w", key, lost)
	}
	if herr != nil {
		d.release(ctx, lease, "the handler failed")
		d.ended(ctx, msg, hstart, OutcomeReleased)
		return herr
	}
	fctx, fcancel := context.WithTimeout(context.WithoutCancel(ctx), d.opts.FinishTimeout)
	defer fcancel()
	fctx, endComplete := telemetry.StartSpan(fctx, d.tel.Tracer, "idem.complete")
	err = d.store.Complete(fctx, lease, slot.get())
	endComplete(err)
	if err != nil {
		d.ended(ctx, msg, hstart, OutcomeCompleteFailed)
		d.opts.Logger.WarnContext(ctx, "idem: completing the key failed after the handler succeeded; the message will be retried once the lease expires",
			slog.String("key_hash", key.Hash()), slog.Any("error", err))
		return fmt.Errorf("consumer: complete %s: %w", key, err)
	}
	d.ended(ctx, msg, hstart, OutcomeCompleted)
	return nil
}

// ended reports how a handler that ran under a claim ended.
func (d *dedupMiddleware) ended(ctx context.Context, msg *Message, hstart time.Time, outcome string) {
	d.tel.Handled(ctx, outcome, time.Since(hstart))
	d.outcome(ctx, msg, outcome)
}

// noEnd ends no span.
func noEnd(error, ...attribute.KeyValue) {}

func (d *dedupMiddleware) release(ctx context.Context, lease *dedup.Lease, why string) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.opts.FinishTimeout)
	defer cancel()
	if err := d.store.Release(rctx, lease); err != nil {
		d.opts.Logger.WarnContext(ctx, "idem: releasing the key failed; it stays claimed until its lease expires",
			slog.String("key_hash", lease.Key.Hash()), slog.String("why", why), slog.Any("error", err))
	}
}

// heartbeat extends a lease until stopped. It runs on a timer
// (time.AfterFunc), so a handler that finishes before the first beat costs no
// goroutine. lostErr is set when the store answered ErrLeaseLost; read it
// only after stop has returned.
type heartbeat struct {
	d       *dedupMiddleware
	lease   *dedup.Lease
	logCtx  context.Context
	base    context.Context // ctx without its cancellation
	lost    context.CancelCauseFunc
	every   time.Duration
	timeout time.Duration

	mu      sync.Mutex
	timer   *time.Timer
	stopped bool
	cancel  context.CancelFunc // cancels an Extend in progress
	running sync.WaitGroup
	lostErr error
}

// stop ends the heartbeat and waits for a beat in progress to return.
func (h *heartbeat) stop() {
	h.mu.Lock()
	if h.stopped {
		h.mu.Unlock()
		return
	}
	h.stopped = true
	if h.timer != nil {
		h.timer.Stop()
	}
	cancel := h.cancel
	h.mu.Unlock()
	if cancel != nil {
		cancel()
	}
	h.running.Wait()
}

func (h *heartbeat) beat() {
	h.mu.Lock()
	if h.stopped {
		h.mu.Unlock()
		return
	}
	h.running.Add(1)
	if h.cancel == nil {
		h.base, h.cancel = context.WithCancel(h.base)
	}
	base := h.base
	h.mu.Unlock()
	defer h.running.Done()

	// Each Extend may take up to the lease's TTL: past that the lease is
	// gone anyway.
	ectx, ecancel := context.WithTimeout(base, h.timeout)
	err := h.d.store.Extend(ectx, h.lease)
	ecancel()
	switch {
	case err == nil:
	case errors.Is(err, dedup.ErrLeaseLost):
		lostErr := fmt.Errorf("consumer: heartbeat: %w", err)
		h.mu.Lock()
		h.lostErr = lostErr
		h.mu.Unlock()
		h.d.opts.Logger.WarnContext(h.logCtx, "idem: lease lost while the handler ran; cancelling it",
			slog.String("key_hash", h.lease.Key.Hash()), slog.Any("error", err))
		h.lost(lostErr)
		return
	case base.Err() != nil:
		return
	default:
		h.d.opts.Logger.WarnContext(h.logCtx, "idem: extending the lease failed; trying again at the next beat",
			slog.String("key_hash", h.lease.Key.Hash()), slog.Any("error", err))
	}
	h.mu.Lock()
	if !h.stopped {
		h.timer.Reset(h.every)
	}
	h.mu.Unlock()
}

func (d *dedupMiddleware) startHeartbeat(ctx context.Context, lease *dedup.Lease, lost context.CancelCauseFunc) *heartbeat {
	every := d.opts.ExtendEvery
	if every == 0 {
		every = lease.TTL / 3
	}
	timeout := lease.TTL
	if timeout <= 0 {
		timeout = every
	}
	// The heartbeat lives as long as the handler runs, not as long as ctx:
	// a handler that finishes its work during a graceful stop keeps its
	// lease.
	hb := &heartbeat{d: d, lease: lease, logCtx: ctx, base: context.WithoutCancel(ctx), lost: lost, every: every, timeout: timeout}
	if every <= 0 {
		hb.stopped = true
		return hb
	}
	hb.mu.Lock()
	hb.timer = time.AfterFunc(every, hb.beat)
	hb.mu.Unlock()
	return hb
}
