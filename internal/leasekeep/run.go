package leasekeep

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/telemetry"
)

// Run is the lease flow of one claimed key, written once for every
// middleware that claims through a dedup.LeaseStore: the handler's context,
// the heartbeat that keeps the lease while the handler runs, and the end of
// the flow — Complete when the handler succeeded, Release when it failed or
// panicked, nothing when the lease was lost meanwhile (another owner may
// hold the key).
//
// Embed a Run in the per-message struct of the middleware (it needs no
// allocation of its own), Begin it once the claim granted a lease, run the
// handler with &r.Ctx (or a context derived from it), then end the flow
// with Settle — or, when the middleware decides what to store itself,
// with Stop and then Complete or Release — and finally End. Abandon ends
// the flow of a handler that panicked.
type Run struct {
	// Ctx is the handler's context: cancelled with an error wrapping
	// dedup.ErrLeaseLost (its cause) when a beat finds the lease gone, and
	// with nil at End.
	Ctx HandlerCtx
	// Lease is the lease the claim granted.
	Lease *dedup.Lease

	k       *Keeper
	parent  context.Context
	finish  time.Duration
	hold    Hold
	fin     Finish
	stopped bool
	lost    error
}

// Begin starts the flow of lease: the handler's context r.Ctx becomes a
// cancel child of hparent (nil: ctx), and the lease is extended every
// `every` (≤ 0: never) until Stop. ctx is the message's context: beats,
// Complete and Release run with its values, not its cancellation, so a
// handler that finishes while the consumer stops keeps its lease and gets
// its key completed. Complete and Release are bounded by finish.
func (k *Keeper) Begin(ctx, hparent context.Context, r *Run, lease *dedup.Lease, every, finish time.Duration) {
	if hparent == nil {
		hparent = ctx
	}
	r.k, r.parent, r.Lease, r.finish = k, ctx, lease, finish
	r.Ctx.Init(hparent)
	k.Start(ctx, &r.hold, lease, every, &r.Ctx)
}

// Stop ends the heartbeat and waits for a beat in progress. It returns the
// lease-lost error a beat saw, or nil while the lease is still owned. It may
// be called more than once.
func (r *Run) Stop() error {
	if !r.stopped {
		r.stopped = true
		r.lost = r.hold.Stop()
	}
	return r.lost
}

// Settle ends the flow after the handler returned herr, storing result on
// success. It returns the handler outcome (telemetry.Handled*) and the
// error the middleware answers with:
//
//   - the lease was lost while the handler ran: HandledLeaseLost, an error
//     wrapping dedup.ErrLeaseLost (and herr): the key cannot be completed.
//   - herr != nil: the key is released so the redelivery runs the handler
//     again; HandledReleased, herr unchanged.
//   - Complete failed: HandledCompleteFailed, an error wrapping the store's
//     (logged; the redelivery runs once the lease has expired).
//   - else HandledCompleted, nil.
//
// tracer, when not nil, records an idem.complete span under the message's
// recording span.
func (r *Run) Settle(herr error, result []byte, tracer trace.Tracer) (string, error) {
	key := r.Lease.Key
	if lost := r.Stop(); lost != nil {
		if herr != nil {
			return telemetry.HandledLeaseLost, fmt.Errorf("%s: handler for %s failed after its lease was lost: %w; handler error: %w", r.k.prefix, key, lost, herr)
		}
		return telemetry.HandledLeaseLost, fmt.Errorf("%s: handler for %s finished after its lease was lost; it cannot be completed: %w", r.k.prefix, key, lost)
	}
	if herr != nil {
		r.Release("the handler failed")
		return telemetry.HandledReleased, herr
	}
	if err := r.Complete(result, tracer); err != nil {
		r.k.logger.WarnContext(r.parent, "idem: completing the key failed after the handler succeeded; the message will be retried once the lease expires",
			slog.String("key_hash", key.Hash()), slog.Any("error", err))
		return telemetry.HandledCompleteFailed, fmt.Errorf("%s: complete %s: %w", r.k.prefix, key, err)
	}
	return telemetry.HandledCompleted, nil
}

// ErrPanicked is the error an idem.handle span records for a handler that
// panicked (or called runtime.Goexit); the panic itself goes on.
var ErrPanicked = errors.New("idem: the handler panicked")

// Abandon ends the flow of a handler that panicked (or called
// runtime.Goexit): the key is released so that a redelivery can run, unless
// the lease was lost meanwhile. It returns the handler outcome.
func (r *Run) Abandon() string {
	if r.Stop() != nil {
		return telemetry.HandledLeaseLost
	}
	r.Release("the handler panicked")
	return telemetry.HandledReleased
}

// Complete marks the key done with result, under the message's values and
// the finish bound, in an idem.complete span when tracer is set and the
// message is traced. Call it after Stop returned nil.
func (r *Run) Complete(result []byte, tracer trace.Tracer) error {
	r.fin.Init(r.parent, r.finish)
	defer r.fin.Close()
	if tracer == nil {
		return r.k.store.Complete(&r.fin, r.Lease, result)
	}
	ctx, end := telemetry.StartSpan(&r.fin, tracer, "idem.complete")
	err := r.k.store.Complete(ctx, r.Lease, result)
	end(err)
	return err
}

// Release gives the key back so a redelivery runs the handler again. A
// failure is logged with why; the lease then expires on its own. Call it
// after Stop returned nil.
func (r *Run) Release(why string) {
	r.fin.Init(r.parent, r.finish)
	err := r.k.store.Release(&r.fin, r.Lease)
	r.fin.Close()
	if err != nil {
		r.k.logger.WarnContext(r.parent, "idem: releasing the key failed; it stays claimed until its lease expires",
			slog.String("key_hash", r.Lease.Key.Hash()), slog.String("why", why), slog.Any("error", err))
	}
}

// End cancels the handler's context and stops the heartbeat if Stop did
// not. Call it once the flow is over, on every path (defer it).
func (r *Run) End() {
	r.Ctx.Cancel(nil)
	_ = r.Stop()
}
