package watermill

import (
	"context"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/leasekeep"
	"github.com/idemkit/idem/internal/telemetry"
)

// call is one message's lease, from the claim to Complete or Release: the
// one allocation the middleware makes per message it runs the handler for.
// It holds everything that must outlive the claim's stack frame: the
// message's delivery (telemetry), the handler's context, the heartbeat's
// Hold and the context of Complete and Release.
//
// While the handler runs, the middleware's leasekeep.Keeper extends the
// lease every `every` (a handler that returns before the first beat, most of
// them, costs no timer: the Keeper has one for all handlers in flight). When
// the handler returned, Complete or Release run under fin: the message
// context's values without its cancellation (like context.WithoutCancel), so
// that a handler that finishes its work while the router stops still gets
// its key completed, bounded by FinishTimeout.
type call struct {
	dl    delivery
	store dedup.LeaseStore
	cfg   *config
	lease *dedup.Lease

	parent context.Context // the message's context, with the consumer span
	msg    *message.Message
	// hctx is the handler's context: cancelled with the lease-lost error
	// when a beat finds the lease gone, with nil when the call ends.
	hctx     leasekeep.HandlerCtx
	returned bool // the handler returned (did not panic)
	// out and herr are what the handler returned. They are kept here, not
	// passed to settle, to keep the frame under the handler small.
	out  []*message.Message
	herr error

	tel       *telemetry.Dedup
	timed     bool      // the duration histograms record
	recording bool      // parent holds a recording span
	hstart    time.Time // the handler's start, when timed
	endHandle spanEnd   // ends the idem.handle span

	hold     leasekeep.Hold
	fin      leasekeep.Finish
	finished bool
	lost     error // the lease-lost error a beat saw
}

// start starts the heartbeat of lc.lease.
func (lc *call) start(keeper *leasekeep.Keeper) {
	every := lc.cfg.ExtendEvery
	if every == 0 {
		every = lc.lease.TTL / 3
	}
	keeper.Start(lc.parent, &lc.hold, lc.lease, every, &lc.hctx)
}

// finish stops the beats, waits for one in progress, and starts the
// FinishTimeout bound of Complete and Release. It returns the lease-lost
// error a beat saw, if any.
func (lc *call) finish() error {
	if !lc.finished {
		lc.finished = true
		lc.lost = lc.hold.Stop()
		lc.fin.Init(lc.parent, lc.cfg.FinishTimeout)
	}
	return lc.lost
}

// end stops the beats if finish did not, and ends fin.
func (lc *call) end() {
	_ = lc.hold.Stop()
	lc.fin.Close()
}

// complete marks the key done, in an idem.complete span when traced.
func (lc *call) complete() error {
	if !lc.recording {
		return lc.store.Complete(&lc.fin, lc.lease, nil)
	}
	ctx, end := telemetry.StartSpan(&lc.fin, lc.tel.Tracer, "idem.complete")
	err := lc.store.Complete(ctx, lc.lease, nil)
	end(err)
	return err
}

// release gives the key back, logging a failure (the lease then expires on
// its own).
func (lc *call) release(why string) {
	if err := lc.store.Release(&lc.fin, lc.lease); err != nil {
		lc.cfg.Logger.WarnContext(lc.parent, "idem: releasing the key failed; it stays claimed until its lease expires",
			slog.String("key_hash", lc.lease.Key.Hash()), slog.String("why", why), slog.Any("error", err))
	}
}
