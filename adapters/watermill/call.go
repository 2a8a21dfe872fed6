package watermill

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/telemetry"
)

// call is one message's lease, from the claim to Complete or Release.
//
// It owns one timer. While the handler runs, the timer beats: it extends the
// lease every `every` (a handler that returns before the first beat, most of
// them, costs the timer and nothing else). When the handler returned, the
// same timer becomes the deadline of Complete or Release (FinishTimeout).
//
// Extend, Complete and Release run with the call itself as their context: it
// carries the message context's values but not its cancellation (like
// context.WithoutCancel), so that a handler that finishes its work while the
// router stops still gets its key completed; it is done at the finish
// deadline (context.DeadlineExceeded) or when the call ends
// (context.Canceled). One object instead of three per message.
type call struct {
	store dedup.LeaseStore
	cfg   *config
	lease *dedup.Lease
	every time.Duration

	parent context.Context // the message's context, for Value
	msg    *message.Message
	// onLost cancels the handler's context: with the lease-lost error
	// when a beat finds the lease gone, with nil when the call ends.
	onLost   context.CancelCauseFunc
	returned bool // the handler returned (did not panic)

	tel       *telemetry.Dedup
	hstart    time.Time // the handler's start
	endHandle spanEnd   // ends the idem.handle span

	mu       sync.Mutex
	phase    int // running, finishing, ended
	timer    *time.Timer
	deadline time.Time // of the finishing phase
	beats    sync.WaitGroup
	lost     error         // a beat's ErrLeaseLost
	err      error         // the context's Err
	done     chan struct{} // the context's Done, made on demand
}

var _ context.Context = (*call)(nil)

// Deadline implements context.Context: the finish deadline is enforced by the
// timer, not announced.
func (lc *call) Deadline() (time.Time, bool) { return time.Time{}, false }

// Value implements context.Context.
func (lc *call) Value(key any) any { return lc.parent.Value(key) }

// Done implements context.Context.
func (lc *call) Done() <-chan struct{} {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	if lc.done == nil {
		lc.done = make(chan struct{})
		if lc.err != nil {
			close(lc.done)
		}
	}
	return lc.done
}

// Err implements context.Context.
func (lc *call) Err() error {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	return lc.err
}

func (lc *call) String() string { return "watermill.call(" + lc.lease.Key.String() + ")" }

// cancelLocked ends the context with err. lc.mu is held.
func (lc *call) cancelLocked(err error) {
	if lc.err != nil {
		return
	}
	lc.err = err
	if lc.done != nil {
		close(lc.done)
	}
}

const (
	running = iota
	finishing
	ended
)

// startCall starts the heartbeat of lease. msgCtx is the message's context;
// onLost cancels the handler's.
func (c *config) startCall(msgCtx context.Context, store dedup.LeaseStore, lease *dedup.Lease, onLost context.CancelCauseFunc) *call {
	lc := &call{store: store, cfg: c, lease: lease, onLost: onLost, every: c.ExtendEvery, parent: msgCtx}
	if lc.every == 0 {
		lc.every = lease.TTL / 3
	}
	if lc.every > 0 {
		lc.mu.Lock()
		lc.timer = time.AfterFunc(lc.every, lc.fire)
		lc.mu.Unlock()
	}
	return lc
}

// fire is the timer's function: a beat while the handler runs, the finish
// deadline afterwards.
func (lc *call) fire() {
	lc.mu.Lock()
	switch lc.phase {
	case ended:
		lc.mu.Unlock()
		return
	case finishing:
		// A beat scheduled before the handler returned can still fire:
		// only the deadline cancels.
		if !time.Now().Before(lc.deadline) {
			lc.cancelLocked(context.DeadlineExceeded)
		}
		lc.mu.Unlock()
		return
	}
	lc.beats.Add(1)
	lc.mu.Unlock()
	defer lc.beats.Done()

	// An Extend may take up to the lease's TTL: past that the lease is gone
	// anyway.
	timeout := lc.lease.TTL
	if timeout <= 0 {
		timeout = lc.every
	}
	ectx, ecancel := context.WithTimeout(lc, timeout) // rare: a beat
	err := lc.store.Extend(ectx, lc.lease)
	ecancel()
	switch {
	case err == nil:
	case errors.Is(err, dedup.ErrLeaseLost):
		lost := fmt.Errorf("watermill: heartbeat: %w", err)
		lc.mu.Lock()
		lc.lost = lost
		lc.mu.Unlock()
		lc.cfg.Logger.WarnContext(lc, "idem: lease lost while the handler ran; cancelling its context",
			slog.String("key_hash", lc.lease.Key.Hash()), slog.Any("error", err))
		lc.onLost(lost)
		return
	case lc.Err() != nil:
		return
	default:
		lc.cfg.Logger.WarnContext(lc, "idem: extending the lease failed; trying again at the next beat",
			slog.String("key_hash", lc.lease.Key.Hash()), slog.Any("error", err))
	}
	lc.mu.Lock()
	if lc.phase == running {
		lc.timer.Reset(lc.every)
	}
	lc.mu.Unlock()
}

// finish stops the beats, waits for one in progress, and starts the
// FinishTimeout deadline of ctx. It returns the lease-lost error a beat saw,
// if any.
func (lc *call) finish() error {
	lc.mu.Lock()
	lc.phase = finishing
	lc.deadline = time.Now().Add(lc.cfg.FinishTimeout)
	if lc.timer != nil {
		lc.timer.Reset(lc.cfg.FinishTimeout)
	} else {
		lc.timer = time.AfterFunc(lc.cfg.FinishTimeout, lc.fire)
	}
	lc.mu.Unlock()
	lc.beats.Wait()
	lc.mu.Lock()
	defer lc.mu.Unlock()
	return lc.lost
}

// end releases the timer and cancels the context.
func (lc *call) end() {
	lc.mu.Lock()
	lc.phase = ended
	if lc.timer != nil {
		lc.timer.Stop()
	}
	lc.cancelLocked(context.Canceled)
	lc.mu.Unlock()
}

// complete marks the key done, in an idem.complete span when traced.
func (lc *call) complete() error {
	ctx, end := telemetry.StartSpan(lc, lc.tel.Tracer, "idem.complete")
	err := lc.store.Complete(ctx, lc.lease, nil)
	end(err)
	return err
}

// release gives the key back, logging a failure (the lease then expires on
// its own).
func (lc *call) release(why string) {
	if err := lc.store.Release(lc, lc.lease); err != nil {
		lc.cfg.Logger.WarnContext(lc, "idem: releasing the key failed; it stays claimed until its lease expires",
			slog.String("key_hash", lc.lease.Key.Hash()), slog.String("why", why), slog.Any("error", err))
	}
}
