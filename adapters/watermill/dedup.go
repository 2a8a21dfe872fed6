package idemwatermill

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/leasekeep"
	"github.com/idemkit/idem/internal/telemetry"
)

// Dedup returns router middleware that runs the handler at most once at a
// time per key and never again once it succeeded, on a lease from store
// (dedup/redisnx, dedup/memstore, or the lease mode of dedup/pgtable). It is
// for effects outside the database; for effects in PostgreSQL use
// Transactional, which is exact.
//
// For each message it builds the key (Options.Scope or the handler name,
// the id from msg.UUID, Options.KeyMetadata or Options.KeyFunc, the payload's
// fingerprint) and claims it:
//
//   - lease granted: the handler runs, with msg.Context() cancelled (cause
//     dedup.ErrLeaseLost) if the lease is lost; the lease is extended every
//     Options.ExtendEvery meanwhile.
//   - the handler succeeds: the key is completed and the handler's messages
//     are returned to the router. If completing fails, an error is
//     returned (the message is nacked; its redelivery runs once the lease
//     has expired).
//   - the handler fails: the lease is released, so the redelivery (or
//     Watermill's Retry middleware) runs the handler again, and the
//     handler's error is returned unchanged. This is the difference from
//     Watermill's Deduplicator, which marks the message before the handler
//     runs and drops the retry.
//   - the handler panics: the lease is released and the panic goes on (to
//     Watermill's Recoverer, or the router).
//   - duplicate (the key completed before): the message is acknowledged
//     without running the handler (nil, nil).
//   - in flight (another delivery holds the lease), or the store failed: an
//     error wrapping dedup.ErrInFlight or the store's error is returned, so
//     Watermill retries or nacks the message; the handler does not run. A
//     store that is down never lets a message through (fail closed).
//   - fingerprint mismatch or invalid key: poison, see Options.PoisonQueue.
//
// Messages the handler returns are published by the router after the key
// was completed; if that publish fails, the message is nacked and its
// redelivery is a duplicate, so they are not sent again. Where that matters,
// use Transactional with Options.Outbox.
//
// Put Dedup inside Watermill's Retry middleware (added after it), so that
// each retry is claimed again, and inside PoisonQueue.
func Dedup(store dedup.LeaseStore, opts Options) (message.HandlerMiddleware, error) {
	if store == nil {
		return nil, errors.New("watermill: Dedup: store is nil; pass a dedup.LeaseStore such as memstore.New, redisnx.New or pgtable's Store.Lease()")
	}
	if opts.Outbox != nil || opts.OutboxTopic != "" || opts.OutboxKey != nil {
		return nil, errors.New("watermill: Dedup: Options.Outbox, OutboxTopic and OutboxKey are for Transactional: a lease cannot commit together with the outbox rows; use Transactional on dedup/pgtable")
	}
	c, err := newConfig("Dedup", opts, store)
	if err != nil {
		return nil, err
	}
	d := &leaseMiddleware{config: c, store: store, keeper: leasekeep.New(store, c.Logger, "watermill")}
	return func(h message.HandlerFunc) message.HandlerFunc {
		// The frame below the handler stays small: claim returns
		// before, settle runs after the handler, and everything the
		// message needs meanwhile is in the call, on the heap. The
		// handler's goroutine (a new one per message in Watermill's
		// router) then needs little more stack than without the
		// middleware; growStack gives it that stack first, while it
		// is shallow and cheap to copy (see stack.go).
		return func(msg *message.Message) ([]*message.Message, error) {
			growStack()
			lc, out, err := d.claim(msg)
			if lc == nil {
				return out, err
			}
			defer lc.cleanup()
			lc.out, lc.herr = h(msg)
			lc.returned = true
			return lc.settle()
		}
	}, nil
}

type leaseMiddleware struct {
	*config
	store  dedup.LeaseStore
	keeper *leasekeep.Keeper
}

// claim starts msg's delivery, builds the key and claims it. It returns the
// call when the lease was granted (the call then owns the delivery); else
// it returns the middleware's answer, with the verdict recorded.
func (d *leaseMiddleware) claim(msg *message.Message) (lc *call, out []*message.Message, err error) {
	dl := d.begin(msg)
	defer func() {
		if lc == nil {
			dl.finish()
		}
	}()
	key, err := d.keys.build(msg)
	if err != nil {
		out, err = dl.verdict(d.rejectKey(&dl, msg, err))
		return nil, out, err
	}
	tel := d.tel.Get(key.Scope)
	ctx := msg.Context()
	// The clock is read only for the duration histograms, when a meter
	// provider records them.
	timed := tel.Timed(ctx)
	var start time.Time
	if timed {
		start = time.Now()
	}
	recording := telemetry.Recording(ctx)
	cctx, end := ctx, spanEnd(nil)
	if recording {
		cctx, end = startClaim(ctx, tel, key)
	}
	lease, err := d.store.Claim(cctx, key)
	if err == nil && lease == nil {
		err = errors.New("the store returned neither a lease nor an error")
	}
	if err != nil {
		out, err = dl.verdict(d.notGranted(&dl, msg, tel, key, err, timed, start, end))
		return nil, out, err
	}
	var hstart time.Time
	if timed {
		hstart = time.Now()
	}
	tel.Claimed(ctx, telemetry.ClaimFirst, hstart.Sub(start))
	endClaim(end, nil, telemetry.ClaimFirst)
	c := &call{dl: dl, cfg: d.config, parent: ctx, msg: msg, key: key,
		tel: tel, timed: timed, recording: recording, hstart: hstart, endHandle: noEndHandle}
	every := d.ExtendEvery
	if every == 0 {
		every = lease.TTL / 3
	}
	d.keeper.Begin(ctx, nil, &c.Run, lease, every, d.FinishTimeout)
	var hctx context.Context = &c.Ctx
	if recording {
		hctx, c.endHandle = telemetry.StartSpan(hctx, tel.Tracer, "idem.handle")
	}
	msg.SetContext(hctx)
	// lc is set only now: a panic before this line leaves the delivery to
	// the deferred finish above.
	return c, nil, nil
}

// notGranted records a claim that granted no lease and returns the
// middleware's answer. It is apart from claim to keep claim's frame, the
// deepest point of the path before the handler, small.
func (d *leaseMiddleware) notGranted(dl *delivery, msg *message.Message, tel *telemetry.Dedup, key dedup.Key, err error, timed bool, start time.Time, end spanEnd) ([]*message.Message, error) {
	o := telemetry.ClaimOutcome(err)
	var took time.Duration
	if timed {
		took = time.Since(start)
	}
	tel.Claimed(msg.Context(), o, took)
	endClaim(end, telemetry.SpanErr(err), o)
	return d.claimFailed(dl, msg, key, err)
}

func noEndHandle(error, ...attribute.KeyValue) {}

// settle completes or releases the key after the handler returned lc.out
// and lc.herr, and records the verdict.
func (lc *call) settle() ([]*message.Message, error) {
	return lc.dl.verdict(lc.answer(lc.out, lc.herr))
}

// answer completes or releases the key and returns the middleware's answer.
func (lc *call) answer(out []*message.Message, herr error) ([]*message.Message, error) {
	lc.endHandle(herr)
	o, err := lc.Settle(herr, nil, lc.tracer())
	lc.handled(o, err)
	switch o {
	case telemetry.HandledCompleted:
		return out, nil
	case telemetry.HandledReleased:
		return out, herr
	}
	return nil, err
}

// handled reports how the handler's run under the lease ended.
func (lc *call) handled(outcome string, err error) {
	var took time.Duration
	if lc.timed {
		took = time.Since(lc.hstart)
	}
	lc.tel.Handled(lc.parent, outcome, took)
	lc.dl.report(lc.key, consumer.Outcome(outcome), err)
}

// cleanup runs after settle, or when the handler panicked: the message gets its
// own context back (so that a retry further out does not run with a
// cancelled one), and the handler's context is cancelled; after a panic (or
// runtime.Goexit) the key is released so that a redelivery can run, the
// delivery records a retry, and the panic goes on.
func (lc *call) cleanup() {
	lc.msg.SetContext(lc.parent)
	if !lc.returned {
		lc.endHandle(leasekeep.ErrPanicked)
		lc.handled(lc.Abandon(), errPanicked)
	}
	lc.End()
	lc.dl.finish()
}
