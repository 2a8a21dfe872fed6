package httpidem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/idemkit/idem/dedup"
)

// heartbeat extends a lease while the handler runs. It is a timer, not a
// goroutine: a handler that returns before the first beat (most of them)
// costs no goroutine at all. stop waits for a beat in progress.
type heartbeat struct {
	mu       sync.Mutex
	stopped  bool
	timer    *time.Timer
	beats    sync.WaitGroup
	cancel   context.CancelFunc // cancels a beat's Extend on stop
	lostErr  error
	disabled bool
}

func (m *Middleware) startHeartbeat(ctx context.Context, lease *dedup.Lease, lost context.CancelCauseFunc) *heartbeat {
	every := m.opts.ExtendEvery
	if every == 0 {
		every = lease.TTL / 3
	}
	if every <= 0 {
		return &heartbeat{disabled: true}
	}
	timeout := lease.TTL
	if timeout <= 0 {
		timeout = every
	}
	// The beats live as long as the handler runs, not as long as the
	// request's context: a handler that finishes after its client went
	// away keeps its lease until it returns.
	hctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	hb := &heartbeat{cancel: cancel}
	beat := func() {
		hb.mu.Lock()
		if hb.stopped {
			hb.mu.Unlock()
			return
		}
		hb.beats.Add(1)
		hb.mu.Unlock()
		defer hb.beats.Done()

		ectx, ecancel := context.WithTimeout(hctx, timeout)
		err := m.lease.Extend(ectx, lease)
		ecancel()
		switch {
		case err == nil:
		case errors.Is(err, dedup.ErrLeaseLost):
			hb.mu.Lock()
			hb.lostErr = fmt.Errorf("httpidem: heartbeat: %w", err)
			hb.mu.Unlock()
			m.opts.Logger.WarnContext(ctx, "httpidem: lease lost while the handler ran; cancelling its context",
				slog.String("key_hash", lease.Key.Hash()), slog.Any("error", err))
			lost(err)
			return
		case hctx.Err() != nil:
			return
		default:
			m.opts.Logger.WarnContext(ctx, "httpidem: extending the lease failed; trying again at the next beat",
				slog.String("key_hash", lease.Key.Hash()), slog.Any("error", err))
		}
		hb.mu.Lock()
		if !hb.stopped {
			hb.timer.Reset(every)
		}
		hb.mu.Unlock()
	}
	hb.mu.Lock()
	hb.timer = time.AfterFunc(every, beat)
	hb.mu.Unlock()
	return hb
}

// stop ends the heartbeat and waits for a beat in progress. It may be
// called more than once.
func (hb *heartbeat) stop() {
	if hb.disabled {
		return
	}
	hb.mu.Lock()
	hb.stopped = true
	hb.timer.Stop()
	hb.mu.Unlock()
	hb.cancel()
	hb.beats.Wait()
}

// lost returns the ErrLeaseLost a beat met, or nil.
func (hb *heartbeat) lost() error {
	if hb.disabled {
		return nil
	}
	hb.mu.Lock()
	defer hb.mu.Unlock()
	return hb.lostErr
}
