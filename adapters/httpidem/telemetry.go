package httpidem

import (
	"context"
	"errors"
	"net/http"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/telemetry"
)

// Message results (idem.result of idem.messages) and dead-letter reasons.
const (
	resultAck        = "ack"
	resultRetry      = "retry"
	resultDeadLetter = "dead_letter"

	reasonMismatch   = "fingerprint_mismatch"
	reasonInvalidKey = "invalid_key"
	reasonTooLarge   = "body_too_large"
	reasonSignature  = "signature_invalid"
)

// Outcomes of idem.lease.wait.duration (idem.wait.outcome): how a wait for
// an in-flight first request ended.
const (
	waitReplayed  = "replayed"  // the first request finished: its response was replayed
	waitAcquired  = "acquired"  // the first request released the key: this one ran the handler
	waitTimedOut  = "timed_out" // Options.Wait ran out: 409
	waitCancelled = "cancelled" // the client went away or the request's deadline passed
	waitError     = "error"     // the store failed, or anything else
)

// instruments are a middleware's metrics.
type instruments struct {
	*telemetry.Scopes
	msgs *telemetry.Adapter
	wait *telemetry.LeaseWait
}

// setTelemetry creates the instruments for the store the middleware
// claims on.
func (m *Middleware) setTelemetry(store any) {
	name := m.opts.StoreName
	if name == "" {
		name = telemetry.StoreName(store)
	}
	m.ins = &instruments{
		Scopes: telemetry.NewScopes(m.opts.MeterProvider, m.opts.TracerProvider, name),
		msgs:   telemetry.NewAdapter(m.opts.MeterProvider, m.opts.TracerProvider, "http"),
		wait:   telemetry.NewLeaseWait(m.opts.MeterProvider),
	}
}

// request is one request's trip through the middleware, for telemetry. It
// lives on the middleware's stack.
type request struct {
	ctx       context.Context // the request's
	key       dedup.Key
	tel       *telemetry.Dedup
	start     time.Time
	hstart    time.Time     // the handler's start (lease stores)
	traced    bool          // the request's span records: idem spans are started
	waited    bool          // the request waited for an in-flight first one
	wait      string        // how the wait ended, when it ended before the final claim
	waitedFor time.Duration // how long it waited
}

func (m *Middleware) begin(r *http.Request, key dedup.Key, start time.Time) request {
	ctx := r.Context()
	return request{
		ctx:    ctx,
		key:    key,
		tel:    m.ins.Get(m.opts.MetricScope(r)),
		start:  start,
		traced: trace.SpanFromContext(ctx).IsRecording(),
	}
}

// claimed records the request's claim: its outcome (a telemetry.Claim*
// constant) and time since start.
func (rq *request) claimed(outcome string, start time.Time) {
	rq.tel.Claimed(rq.ctx, outcome, time.Since(start))
}

// handled records how the handler's run under the claim ended: completed,
// released, lease_lost or complete_failed.
func (rq *request) handled(outcome string) {
	rq.tel.Handled(rq.ctx, outcome, time.Since(rq.hstart))
}

// tracer is the tracer of the idem.complete span, nil when the request is
// not traced.
func (rq *request) tracer() trace.Tracer {
	if !rq.traced {
		return nil
	}
	return rq.tel.Tracer
}

// spanEnd ends a span started by telemetry.StartSpan.
type spanEnd = func(err error, more ...attribute.KeyValue)

// startSpan starts an idem span under the request's span, when it records.
// end is nil when there is no span.
func (rq *request) startSpan(ctx context.Context, name string, attrs ...attribute.KeyValue) (context.Context, spanEnd) {
	if !rq.traced {
		return ctx, nil
	}
	return telemetry.StartSpan(ctx, rq.tel.Tracer, name, attrs...)
}

// startClaim starts the idem.claim span; the key's hash is computed only
// then.
func (rq *request) startClaim(ctx context.Context, key dedup.Key) (context.Context, spanEnd) {
	if !rq.traced {
		return ctx, nil
	}
	return telemetry.StartSpan(ctx, rq.tel.Tracer, "idem.claim", rq.tel.SpanAttrs(key.Hash())...)
}

func endSpan(end spanEnd, err error, more ...attribute.KeyValue) {
	if end != nil {
		end(err, more...)
	}
}

// claimOutcome maps a claim's error to the idem.claims outcome: a stored
// response is a duplicate (replayed), a PostgreSQL lock timeout is in
// flight.
func claimOutcome(err error) string {
	switch {
	case err == nil:
		return telemetry.ClaimFirst
	case errors.Is(err, dedup.ErrDuplicate):
		return telemetry.ClaimDuplicate
	case errors.Is(err, dedup.ErrFingerprintMismatch):
		return telemetry.ClaimFingerprintMismatch
	case inFlight(err):
		return telemetry.ClaimInFlight
	case errors.Is(err, dedup.ErrInvalidKey):
		return telemetry.ClaimInvalidKey
	}
	return telemetry.ClaimError
}

// spanErr is the error a claim span records: none for a duplicate or a key
// in flight, which are answers, not failures.
func spanErr(err error) error {
	if errors.Is(err, dedup.ErrDuplicate) || inFlight(err) {
		return nil
	}
	return err
}

// rejection maps a problem the middleware answered before any claim to the
// idem.claims outcome ("" when it is not about the key) and the message's
// result and reason.
func rejection(p *Problem) (claim, result, reason string) {
	switch p.Type {
	case problemKeyMissing, problemKeyInvalid, problemEventIDMissing:
		return telemetry.ClaimInvalidKey, resultDeadLetter, reasonInvalidKey
	case problemBodyTooLarge:
		return "", resultDeadLetter, reasonTooLarge
	case problemSignatureInvalid:
		return "", resultDeadLetter, reasonSignature
	}
	// The body could not be read (the client went away): nothing
	// happened, the same request can be sent again.
	return "", resultRetry, ""
}

// result maps a request's Outcome to the idem.messages result and reason.
func (m *Middleware) result(o outcome) (result, reason string) {
	switch o {
	case outcomeProcessed, outcomeReplayed:
		return resultAck, ""
	case outcomeTooLarge:
		if m.tx == nil {
			return resultAck, "" // the 500 is stored and replayed
		}
		return resultRetry, "" // rolled back
	case outcomeMismatch:
		return resultDeadLetter, reasonMismatch
	case outcomeRejected:
		return resultDeadLetter, reasonInvalidKey
	}
	// in_flight, store_error, not_stored, lease_lost, panicked: nothing is
	// stored, a retry with the same key runs the handler again.
	return resultRetry, ""
}

// waitOutcome says how a wait that lasted until the final claim ended.
func waitOutcome(o outcome) string {
	switch o {
	case outcomeReplayed:
		return waitReplayed
	case outcomeInFlight:
		return waitTimedOut
	case outcomeProcessed, outcomeNotStored, outcomeTooLarge, outcomeLeaseLost, outcomePanicked:
		return waitAcquired
	}
	return waitError
}

// finish records the request's verdict (idem.messages) and its wait.
func (m *Middleware) finish(rq *request, o outcome) {
	result, reason := m.result(o)
	m.ins.msgs.Result(rq.ctx, rq.tel.Scope(), result, reason, time.Since(rq.start))
	if rq.waited {
		w := rq.wait
		if w == "" {
			w = waitOutcome(o)
		}
		m.ins.wait.Record(rq.ctx, rq.tel.Scope(), w, rq.waitedFor)
	}
}
