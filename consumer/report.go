package consumer

import (
	"context"
	"errors"
	"time"

	"github.com/idemkit/idem/dedup"
)

// Outcome is how idem handled one message or request. Every component
// reports with the same vocabulary: the consumer middleware, the Kafka,
// RabbitMQ and Watermill adapters and the HTTP middleware. The same words
// say why Decide chose its Action (Result.Reason). The value is a short
// snake_case word, usable as a metric label.
type Outcome string

// Outcomes.
const (
	// The handler succeeded and the key was marked done (or the
	// transaction that claimed it committed).
	OutcomeCompleted Outcome = "completed"
	// The key was already processed: the handler did not run. The HTTP
	// middleware replayed the stored response.
	OutcomeDuplicate Outcome = "duplicate"
	// Another owner holds the key: the handler did not run.
	OutcomeInFlight Outcome = "in_flight"
	// The key was seen with other content: the handler did not run.
	OutcomeFingerprintMismatch Outcome = "fingerprint_mismatch"
	// The input has no valid key: the store was not asked.
	OutcomeInvalidKey Outcome = "invalid_key"
	// The store failed the claim: the handler did not run (fail closed).
	OutcomeStoreError Outcome = "store_error"
	// The handler failed or panicked and the claim was given back (a
	// lease is released; a claiming transaction rolled back).
	OutcomeReleased Outcome = "released"
	// The lease was lost while the handler ran.
	OutcomeLeaseLost Outcome = "lease_lost"
	// The handler succeeded but marking the key done failed.
	OutcomeCompleteFailed Outcome = "complete_failed"
	// The handler returned an error that no claim stood behind: an
	// adapter reports it for a chain without Dedup or Transactional.
	OutcomeFailed Outcome = "failed"
	// The input needed no key and went to the handler unclaimed (the HTTP
	// middleware passes methods it does not guard).
	OutcomePassed Outcome = "passed"

	// The following are reasons of a Result (Result.Reason), next to
	// OutcomeDuplicate, OutcomeInFlight, OutcomeLeaseLost,
	// OutcomeFingerprintMismatch and OutcomeInvalidKey. The dead-letter
	// reasons are outcomes as well: Result.Outcome of a dead-lettered
	// message is its reason.

	// Retry: the Timeout middleware's deadline fired.
	OutcomeTimeout Outcome = "timeout"
	// Retry: any other error.
	OutcomeTransient Outcome = "transient"
	// Dead letter: the handler panicked.
	OutcomePanic Outcome = "panic"
	// Dead letter: the Retry middleware gave up.
	OutcomeRetriesExhausted Outcome = "retries_exhausted"
	// Dead letter: the error was marked with Permanent.
	OutcomePermanent Outcome = "permanent"
)

// Report is what an OnOutcome callback receives, once per message or
// request. Every component's OnOutcome field has the same type:
//
//	OnOutcome func(ctx context.Context, r consumer.Report)
//
// It is for application counters and logs; OpenTelemetry metrics and spans
// carry the same facts. A callback must be fast and safe for concurrent use.
type Report struct {
	// Outcome is how the message was handled.
	Outcome Outcome
	// Key is the claimed key; zero when the input carried no valid key.
	Key dedup.Key
	// Message is the message; nil for an HTTP request and a Watermill
	// message (Key.ID names them).
	Message *Message
	// Result is the ACK rule applied to the message: set by the Kafka and
	// RabbitMQ adapters, which report once the message is settled
	// (acknowledged, or written to the dead-letter path, and its offset
	// marked for commit); zero from middleware, which reports before the
	// verdict exists.
	Result Result
	// Err is the error that stopped the work, when there is one: the
	// handler's, the store's, or the broker's when the verdict could not
	// be delivered (the channel closed before the ACK, the commit failed).
	Err error
	// Waited is how long the component waited on another owner of the key
	// before this outcome (the HTTP middleware's Wait).
	Waited time.Duration
	// Status is the HTTP middleware's response status; zero elsewhere.
	Status int
}

// report calls fn, if set.
func report(ctx context.Context, fn func(context.Context, Report), r Report) {
	if fn != nil {
		fn(ctx, r)
	}
}

// Outcome is the Outcome of a verdict reached without a claim in sight:
// what an adapter reports from the Result of a chain (success, a
// duplicate, a key in flight, poison, or a handler error). A dead letter
// (ActionDeadLetter, or DeadLettered by the DeadLetter middleware) is
// reported with its Reason, the word an adapter also writes as the dead
// letter's reason: permanent, panic, retries_exhausted,
// fingerprint_mismatch, invalid_key, or an adapter's own.
func (r Result) Outcome() Outcome {
	switch {
	case r.Duplicate:
		return OutcomeDuplicate
	case (r.Action == ActionDeadLetter || r.DeadLettered) && r.Reason != "":
		return r.Reason
	case r.Err == nil:
		return OutcomeCompleted
	case errors.Is(r.Err, dedup.ErrLeaseLost):
		return OutcomeLeaseLost
	}
	if o := claimOutcome(r.Err); o != OutcomeStoreError {
		return o
	}
	return OutcomeFailed
}
