package consumer

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/idemkit/idem/dedup"
)

// Action is what an adapter does with a delivery once the handler chain has
// returned. The zero Action is not valid; an adapter treats anything other
// than ActionAck and ActionDeadLetter as "do not acknowledge".
type Action int

const (
	// ActionAck acknowledges the message (commits the offset): its effect
	// committed, it was a completed duplicate, or it was dead-lettered.
	ActionAck Action = iota + 1
	// ActionRetry leaves the message unacknowledged so it comes back: nack
	// with requeue, or do not commit the offset and retry after a backoff.
	// Result.RetryAfter is a hint for the delay.
	ActionRetry
	// ActionDeadLetter parks the message in the broker's dead-letter path
	// (or the adapter's) and then acknowledges it. It is returned when no
	// DeadLetter middleware is installed, or when one is and the chain
	// bypassed it.
	ActionDeadLetter
)

// String returns "ack", "retry" or "dead_letter".
func (a Action) String() string {
	switch a {
	case ActionAck:
		return "ack"
	case ActionRetry:
		return "retry"
	case ActionDeadLetter:
		return "dead_letter"
	}
	return "Action(" + strconv.Itoa(int(a)) + ")"
}

// Result is the ACK rule applied to one delivery. Adapters act on Action;
// the other fields are for logs, metrics and delays.
type Result struct {
	Action Action
	// Duplicate is set when the message is acknowledged because its key
	// was already processed. The first owner's stored result is
	// dedup.StoredResult(Err).
	Duplicate bool
	// DeadLettered is set when the message is acknowledged because a
	// DeadLetter middleware already parked it; Reason is why.
	DeadLettered bool
	// Reason says why, in the Outcome vocabulary: OutcomeDuplicate,
	// OutcomeInFlight, OutcomeLeaseLost, OutcomeTimeout or
	// OutcomeTransient for a retry; OutcomePanic,
	// OutcomeFingerprintMismatch, OutcomeInvalidKey,
	// OutcomeRetriesExhausted or OutcomePermanent for a dead letter (an
	// adapter may add its own, such as a redelivery limit). Empty on
	// success.
	Reason Outcome
	// Err is the handler chain's error, nil on success.
	Err error
	// RetryAfter is a hint for the delay before the retry: for
	// OutcomeInFlight, how long the other owner's lease has left when the
	// store can tell; zero otherwise.
	RetryAfter time.Duration
}

// Decide applies the ACK rule to the error a handler chain returned. The
// first matching line wins:
//
//  1. nil: Ack.
//  2. the DeadLetter middleware parked the message: Ack,
//     DeadLettered, with the dead-letter reason.
//  3. the DeadLetter middleware could not park it (its hook failed, or the
//     consumer was stopping): Retry, transient. A message is never
//     acknowledged before it is parked.
//  4. dedup.ErrDuplicate: Ack, Duplicate.
//  5. dedup.ErrLeaseLost: Retry, lease_lost; the redelivery finds the new
//     owner's state.
//  6. dedup.ErrInFlight: Retry, in_flight, RetryAfter from the
//     *dedup.ClaimError.
//  7. *PanicError: DeadLetter, panic.
//  8. dedup.ErrFingerprintMismatch: DeadLetter, fingerprint_mismatch.
//  9. dedup.ErrInvalidKey: DeadLetter, invalid_key.
//  10. *RetriesExhaustedError: DeadLetter, retries_exhausted.
//  11. the Timeout middleware's deadline ended the handler: Retry, timeout.
//  12. marked with Permanent: DeadLetter, permanent.
//  13. anything else, including context.Canceled and
//     context.DeadlineExceeded: Retry, transient.
//
// The order encodes the precedence: facts that the work is done (2, 4) beat
// everything; facts about who owns the key (5, 6) beat every
// classification, because dead-lettering a message that another consumer is
// processing right now would be wrong, while retrying it is always safe — so
// Permanent(dedup.ErrInFlight) is retried, and exhausted retries whose last
// attempt found the key in flight are retried too. Specific poison reasons
// (7–10) beat the generic Permanent mark so that metrics say which poison it
// was. A timeout (11) beats Permanent because whatever the handler returned
// after its deadline fired is a consequence of the deadline.
//
// Decide looks at the error only. DecideContext (and Process, which calls
// it) also looks at the consumer's context: while it is done, nothing is
// dead-lettered.
func Decide(err error) Result {
	if err == nil {
		// The common case, decided before the errors.As targets below
		// are allocated.
		return Result{Action: ActionAck}
	}
	r := Result{Err: err}
	var (
		dl  *deadLetteredError
		dlf *deadLetterFailedError
		pe  *PanicError
		rx  *RetriesExhaustedError
		te  *timeoutError
		pm  *permanentError
	)
	switch {
	case errors.As(err, &dl):
		r.Action, r.DeadLettered, r.Reason = ActionAck, true, dl.Reason
	case errors.As(err, &dlf):
		r.Action, r.Reason = ActionRetry, OutcomeTransient
	case errors.Is(err, dedup.ErrDuplicate):
		r.Action, r.Duplicate, r.Reason = ActionAck, true, OutcomeDuplicate
	case errors.Is(err, dedup.ErrLeaseLost):
		r.Action, r.Reason = ActionRetry, OutcomeLeaseLost
	case errors.Is(err, dedup.ErrInFlight):
		r.Action, r.Reason = ActionRetry, OutcomeInFlight
		var ce *dedup.ClaimError
		if errors.As(err, &ce) && ce.RetryAfter > 0 {
			r.RetryAfter = ce.RetryAfter
		}
	case errors.As(err, &pe):
		r.Action, r.Reason = ActionDeadLetter, OutcomePanic
	case errors.Is(err, dedup.ErrFingerprintMismatch):
		r.Action, r.Reason = ActionDeadLetter, OutcomeFingerprintMismatch
	case errors.Is(err, dedup.ErrInvalidKey):
		r.Action, r.Reason = ActionDeadLetter, OutcomeInvalidKey
	case errors.As(err, &rx):
		r.Action, r.Reason = ActionDeadLetter, OutcomeRetriesExhausted
	case errors.As(err, &te):
		r.Action, r.Reason = ActionRetry, OutcomeTimeout
	case errors.As(err, &pm):
		r.Action, r.Reason = ActionDeadLetter, OutcomePermanent
	default:
		r.Action, r.Reason = ActionRetry, OutcomeTransient
	}
	return r
}

// DecideContext is Decide with the stopping rule on top: while ctx (the
// consumer's) is done, nothing is dead-lettered. An error that arrives
// while the consumer is stopping may be a consequence of the stop, so a
// dead letter becomes ActionRetry, OutcomeTransient, with Err kept, and
// the redelivery classifies the message again. Other results are Decide's.
//
// Process calls it; an adapter that runs the handler chain itself (a batch
// handler, whose errors come back one per message) calls it on each error.
func DecideContext(ctx context.Context, err error) Result {
	r := Decide(err)
	if r.Action == ActionDeadLetter && ctx.Err() != nil {
		r = Result{Action: ActionRetry, Reason: OutcomeTransient, Err: err}
	}
	return r
}

// Process runs h on msg and applies the ACK rule to the outcome
// (DecideContext: Decide, and no dead letter while ctx is done). It is what
// adapters call for each delivery.
func Process(ctx context.Context, h Handler, msg *Message) Result {
	return DecideContext(ctx, h.Handle(ctx, msg))
}
