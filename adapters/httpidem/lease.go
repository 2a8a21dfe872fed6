package httpidem

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/internal/leasekeep"
	"github.com/idemkit/idem/internal/telemetry"
)

// serveLease runs a request on a lease store: the claim (waiting for an
// in-flight first request when Options.Wait is set), then the handler under
// the lease flow of leasekeep.Run, and the response stored as the key's
// result.
func (m *Middleware) serveLease(w http.ResponseWriter, r *http.Request, next http.Handler, key dedup.Key, rq *request) {
	ctx := r.Context()
	lease, err := m.claimLease(ctx, key, rq)
	if err != nil {
		m.answer(w, r, rq, err)
		return
	}
	rq.hstart = time.Now()
	c := &call{key: key}
	every := m.opts.ExtendEvery
	if every == 0 {
		every = lease.TTL / 3
	}
	// The beats live as long as the handler runs, not as long as the
	// request's context: a handler that finishes after its client went
	// away keeps its lease until it returns.
	m.keeper.Begin(ctx, withCall(m.handlerCtx(ctx), c), &c.Run, lease, every, m.opts.FinishTimeout)
	defer c.End()
	hctx, endHandle := rq.startSpan(&c.Ctx, "idem.handle")
	cw := newCapture(m.opts.MaxResponseBytes)
	returned := false
	defer func() {
		if returned {
			return
		}
		// The handler panicked (or called runtime.Goexit): give the key
		// back so a retry runs, and let the panic go on to the server.
		endSpan(endHandle, leasekeep.ErrPanicked)
		rq.handled(c.Abandon())
		m.done(rq, r, outcomePanicked, 0, leasekeep.ErrPanicked)
	}()
	next.ServeHTTP(cw, r.WithContext(hctx))
	returned = true
	lost := c.Stop()
	endSpan(endHandle, nil)
	m.settleLease(w, r, rq, c, cw, lost)
}

// claimLease claims key, and while Options.Wait allows, claims it again as
// long as it is in flight. It records the claim (one per request, by its
// final answer) and the wait's state in rq.
func (m *Middleware) claimLease(ctx context.Context, key dedup.Key, rq *request) (*dedup.Lease, error) {
	start := time.Now()
	cctx, endClaim := rq.startClaim(ctx, key)
	lease, err := m.lease.Claim(cctx, key)
	for err != nil && m.opts.Wait > 0 && inFlight(err) {
		d, ok := m.waitStep(start)
		if !ok {
			break
		}
		rq.waited = true
		if !backoff.Sleep(ctx, d) {
			rq.wait = waitCancelled
			rq.waitedFor = time.Since(start)
			break
		}
		l, nerr := m.lease.Claim(cctx, key)
		rq.waitedFor = time.Since(start)
		if clientLeft(ctx, nerr) {
			// The request's context ended during this claim rather than
			// during the pause: the wait was cancelled, and the last
			// answer (in flight) stands.
			rq.wait = waitCancelled
			break
		}
		lease, err = l, nerr
	}
	if err == nil && lease == nil {
		err = errors.New("the store returned neither a lease nor an error")
	}
	o := claimOutcome(err)
	rq.claimed(o, start)
	if endClaim != nil {
		endClaim(spanErr(err), telemetry.AttrOutcome.String(o))
	}
	return lease, err
}

// settleLease ends the lease flow of a handler that returned (lost: the
// lease-lost error Stop returned) and sends the response.
func (m *Middleware) settleLease(w http.ResponseWriter, r *http.Request, rq *request, c *call, cw *capture, lost error) {
	status, header := cw.final()
	switch {
	case lost != nil:
		// Another request may own the key now: this response cannot be
		// stored. The client still gets it: the effect happened.
		m.opts.Logger.WarnContext(r.Context(), "httpidem: the lease ran out while the handler ran; its response is sent but not stored",
			slog.String("key_hash", c.key.Hash()), slog.Any("error", lost))
		cw.send(w)
		rq.handled(telemetry.HandledLeaseLost)
		m.done(rq, r, outcomeLeaseLost, status, lost)
	case cw.tooLarge:
		p := tooLargeProblem(m.opts.MaxResponseBytes)
		err := m.complete(r.Context(), rq, c, problemRecord(p).encode())
		rq.handled(completion(err))
		WriteProblem(w, p)
		m.done(rq, r, outcomeTooLarge, p.Status, err)
	case c.released.Load() || !m.opts.StoreResponse(status):
		c.Release("the response is not stored")
		rq.handled(telemetry.HandledReleased)
		cw.send(w)
		m.done(rq, r, outcomeNotStored, status, nil)
	default:
		err := m.complete(r.Context(), rq, c, encodeResponse(status, header, m.opts.ReplayHeaders, cw.body))
		rq.handled(completion(err))
		cw.send(w)
		o := outcomeProcessed
		if err != nil {
			o = outcomeCompleteFailed
		}
		m.done(rq, r, o, status, err)
	}
}

// completion is the handler outcome of a Complete that returned err.
func completion(err error) string {
	if err != nil {
		return telemetry.HandledCompleteFailed
	}
	return telemetry.HandledCompleted
}

// complete stores the response as the key's result, in an idem.complete
// span when the request is traced.
func (m *Middleware) complete(ctx context.Context, rq *request, c *call, result []byte) error {
	err := c.Complete(result, rq.tracer())
	if err != nil {
		// The key stays in flight until its lease runs out; a retry
		// after that runs the handler again. Nothing better can be done
		// for an effect outside a transaction.
		m.opts.Logger.WarnContext(ctx, "httpidem: storing the response failed; the key stays in flight until its lease runs out",
			slog.String("key_hash", c.key.Hash()), slog.Any("error", err))
	}
	return err
}
