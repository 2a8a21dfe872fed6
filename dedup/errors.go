package dedup

import (
	"errors"
	"fmt"
	"time"
)

// Sentinel errors. Stores wrap them; check with errors.Is.
var (
	// ErrDuplicate: the key was already processed to completion. The
	// message must be acknowledged without running the handler.
	ErrDuplicate = errors.New("dedup: duplicate: already processed")
	// ErrInFlight: another owner holds the key's lease right now. Do not
	// acknowledge; retry later.
	ErrInFlight = errors.New("dedup: in flight: another owner holds the key")
	// ErrLeaseLost: the caller's lease expired or was taken over. The caller
	// must not treat its work as completed.
	ErrLeaseLost = errors.New("dedup: lease lost")
	// ErrOutcomeUnknown: the call reached the store, or may have, and its
	// answer was lost (the connection broke after the request was sent,
	// or the context ended while the store was working on it). The call
	// may or may not have taken effect: a Complete so answered may have
	// marked the key done, a Release may have deleted the claim. Stores
	// return it instead of sending such a call again, because a second
	// run would find the first one's effect and answer ErrLeaseLost to an
	// owner whose call succeeded. Do not acknowledge the message: its
	// redelivery's claim finds out what happened (ErrDuplicate when the
	// Complete took effect, a new lease when the key was released,
	// ErrInFlight until the old lease runs out when neither happened).
	ErrOutcomeUnknown = errors.New("dedup: outcome unknown: the store's answer was lost")
	// ErrFingerprintMismatch: the key was seen with different content.
	// The message is never processed and goes to the dead-letter path.
	ErrFingerprintMismatch = errors.New("dedup: fingerprint mismatch: same key, different content")
	// ErrInvalidKey: the key is empty, too long, or has control bytes.
	ErrInvalidKey = errors.New("dedup: invalid key")
	// ErrClosed: the store was closed.
	ErrClosed = errors.New("dedup: store closed")
)

// ClaimError is returned by a claim that did not grant ownership because of
// the key's state. Err is ErrDuplicate, ErrInFlight or ErrFingerprintMismatch;
// errors.Is sees through to it.
type ClaimError struct {
	Err error
	Key Key
	// Result is what the first owner stored when it completed (ErrDuplicate
	// only; nil when nothing was stored).
	Result []byte
	// RetryAfter is how long the current lease has left (ErrInFlight only;
	// zero when the store cannot tell).
	RetryAfter time.Duration
}

func (e *ClaimError) Error() string {
	return fmt.Sprintf("%v (key %s)", e.Err, e.Key)
}

func (e *ClaimError) Unwrap() error { return e.Err }

// StoredResult returns the result carried by a duplicate error, and whether
// err is a duplicate at all.
func StoredResult(err error) ([]byte, bool) {
	// The answer every store gives a duplicate, as it is: no errors.As,
	// which allocates, on the path of every replay.
	if ce, ok := err.(*ClaimError); ok && ce.Err == ErrDuplicate { //nolint:errorlint // the fast path; wrapped errors take the general one below
		return ce.Result, true
	}
	var ce *ClaimError
	if errors.As(err, &ce) && errors.Is(ce.Err, ErrDuplicate) {
		return ce.Result, true
	}
	return nil, errors.Is(err, ErrDuplicate)
}
