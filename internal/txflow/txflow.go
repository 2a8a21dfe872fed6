// Package txflow is the transaction flow of every idem middleware that
// claims through a dedup.TxStore (consumer.Transactional and the Watermill
// transactional middleware), written once:
// the claim, the handler and the commit run in one store.Process, and the
// claim, handler and commit telemetry is recorded the same way for all of
// them. The middleware keep only what is theirs: building the key, the
// handler's inputs and outputs, and the answer to their broker or client.
package txflow

import (
	"context"
	"errors"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/leasekeep"
	"github.com/idemkit/idem/internal/telemetry"
)

// Result is how one run of the flow ended.
type Result struct {
	// Ran reports whether the claim was won and the handler ran.
	Ran bool
	// HandlerErr is what the handler returned, when it ran.
	HandlerErr error
	// Err is what store.Process returned: nil when the claim, the
	// handler's writes and its result committed.
	Err error
}

// Handled is the handler outcome (telemetry.Handled*) of a run whose
// handler ran.
func (r Result) Handled() string {
	switch {
	case r.Err == nil:
		return telemetry.HandledCompleted
	case r.HandlerErr != nil, Held(r.Err):
		// The handler failed, or a claim that does not wait for this
		// transaction took the key first: rolled back either way.
		return telemetry.HandledReleased
	}
	return telemetry.HandledCompleteFailed
}

// Verdict is the claim's verdict for the middleware's answer: nil when the
// handler ran and its own run decided (committed when Err is nil; else
// HandlerErr, or the commit failed), else the
// error of the claim that lost (a duplicate, a key in flight, a
// fingerprint mismatch, an invalid key or a store error). A handler that
// ran and then found the key taken by a claim that does not wait for this
// transaction (pgtable's lease mode on the same table) has that claim's
// verdict too: it is answered as if it had come first.
func (r Result) Verdict() error {
	if r.Ran && !Held(r.Err) {
		return nil
	}
	return r.Err
}

// Process runs h in store.Process for key, with the handler's context
// carrying an idem.handle span, and records the telemetry of the run on tel: the idem.claims outcome and claim duration, the claim span,
// the handler's duration by outcome, and the commit span. A panic in h goes
// on after the run is recorded as released (store.Process rolled back).
func Process[Tx any](ctx context.Context, store dedup.TxStore[Tx], key dedup.Key, tel *telemetry.Dedup,
	h func(ctx context.Context, tx Tx) ([]byte, error)) Result {
	var (
		r            Result
		start        = time.Now()
		hStart, hEnd time.Time
		returned     bool
	)
	defer func() {
		if r.Ran && !returned {
			tel.Handled(ctx, telemetry.HandledReleased, time.Since(hStart))
		}
	}()
	_, r.Err = store.Process(ctx, key, func(ctx context.Context, tx Tx) ([]byte, error) {
		r.Ran = true
		hStart = time.Now()
		tel.Claimed(ctx, telemetry.ClaimFirst, hStart.Sub(start))
		if telemetry.Recording(ctx) {
			telemetry.RecordSpan(ctx, tel.Tracer, "idem.claim", start, hStart, nil,
				append(tel.SpanAttrs(key.Hash()), telemetry.AttrOutcome.String(telemetry.ClaimFirst))...)
		}
		hctx, endHandle := telemetry.StartSpan(ctx, tel.Tracer, "idem.handle")
		ended := false
		defer func() {
			if !ended { // h panicked: the span ends with it
				endHandle(leasekeep.ErrPanicked)
			}
		}()
		result, err := h(hctx, tx)
		ended = true
		endHandle(err)
		hEnd = time.Now()
		r.HandlerErr = err
		if err != nil {
			return nil, err
		}
		return result, nil
	})
	returned = true
	end := time.Now()
	if !r.Ran {
		o := telemetry.ClaimOutcome(r.Err)
		tel.Claimed(ctx, o, end.Sub(start))
		if telemetry.Recording(ctx) {
			telemetry.RecordSpan(ctx, tel.Tracer, "idem.claim", start, end, telemetry.SpanErr(r.Err),
				append(tel.SpanAttrs(key.Hash()), telemetry.AttrOutcome.String(o))...)
		}
		return r
	}
	if r.HandlerErr == nil {
		telemetry.RecordSpan(ctx, tel.Tracer, "idem.commit", hEnd, end, r.Err)
	}
	tel.Handled(ctx, r.Handled(), end.Sub(hStart))
	return r
}

// Held reports whether err is a store's answer that another claim holds
// the key: dedup.ErrDuplicate, dedup.ErrInFlight or
// dedup.ErrFingerprintMismatch. A caller acts on it like on the answer to its
// own claim, even when it came after its handler ran (pgtable.Process losing
// to a claim that does not take the key's lock).
func Held(err error) bool {
	return errors.Is(err, dedup.ErrDuplicate) || errors.Is(err, dedup.ErrInFlight) || errors.Is(err, dedup.ErrFingerprintMismatch)
}
