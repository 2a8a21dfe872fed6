package consumer

import (
	"fmt"
	"time"
)

// Permanent marks err as not worth retrying: Decide dead-letters it with
// OutcomePermanent. errors.Is and errors.As see through the mark to err.
// Permanent(nil) is nil.
//
// Some errors cannot be made permanent by the mark because they describe the
// key's ownership or state rather than the message: dedup.ErrDuplicate is
// still acknowledged, dedup.ErrInFlight and dedup.ErrLeaseLost are still
// retried (see Decide).
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := err.(*permanentError); ok { //nolint:errorlint // only an unwrapped mark is returned as is; a wrapped one gets a new mark
		return err
	}
	return &permanentError{err: err}
}

type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// PanicError is a panic recovered by the Recover middleware. Recover returns
// it marked Permanent: a handler that panics on a message is expected to
// panic on every redelivery of it (poison message).
//
// PanicError deliberately has no Unwrap, even when Value is an error: a
// panic is classified as a panic, whatever value it carries.
type PanicError struct {
	// Value is what the handler passed to panic.
	Value any
	// Stack is the goroutine's stack at the panic (runtime/debug.Stack).
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("consumer: handler panicked: %v", e.Value) }

// RetriesExhaustedError is returned by the Retry middleware when every
// attempt failed with a retryable error; errors.As finds it, and errors.Is/As
// see through to the last attempt's error. Decide dead-letters it
// (OutcomeRetriesExhausted), except when the last attempt found the key in
// flight elsewhere or lost its lease: those are about who owns the key, not
// about the message, so they stay retries.
type RetriesExhaustedError struct {
	// Attempts is how many times the handler ran.
	Attempts int
	// Err is the last attempt's error.
	Err error
}

func (e *RetriesExhaustedError) Error() string {
	return fmt.Sprintf("consumer: retries exhausted after %d attempts: %v", e.Attempts, e.Err)
}

func (e *RetriesExhaustedError) Unwrap() error { return e.Err }

// timeoutError is returned by the Timeout middleware when its deadline, not
// the caller's context, ended the handler. Decide retries it with
// OutcomeTimeout.
type timeoutError struct {
	// Timeout is the middleware's per-message limit.
	Timeout time.Duration
	// Err is what the handler returned after the deadline.
	Err error
}

func (e *timeoutError) Error() string {
	return fmt.Sprintf("consumer: handler timed out after %v: %v", e.Timeout, e.Err)
}

func (e *timeoutError) Unwrap() error { return e.Err }

// deadLetteredError is returned by the DeadLetter middleware after its hook
// parked the message. Decide acknowledges it (Result.DeadLettered) and keeps
// its Reason. errors.Is/As see through to the cause.
type deadLetteredError struct {
	// Reason is why the message was dead-lettered.
	Reason Outcome
	// Err is the error that made the message dead.
	Err error
}

func (e *deadLetteredError) Error() string {
	return fmt.Sprintf("consumer: dead-lettered (%s): %v", e.Reason, e.Err)
}

func (e *deadLetteredError) Unwrap() error { return e.Err }

// deadLetterFailedError is returned by the DeadLetter middleware when the
// message should have been dead-lettered but was not (the hook failed, or the
// consumer is stopping). Decide retries it whatever the cause says: the
// message must not be acknowledged before it is parked somewhere.
type deadLetterFailedError struct {
	reason Outcome
	cause  error
	why    error
}

func (e *deadLetterFailedError) Error() string {
	return fmt.Sprintf("consumer: not dead-lettered (%s): %v; cause: %v", e.reason, e.why, e.cause)
}

func (e *deadLetterFailedError) Unwrap() []error { return []error{e.why, e.cause} }
