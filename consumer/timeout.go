package consumer

import (
	"context"
	"errors"
	"time"
)

var errTimeout = errors.New("consumer: per-message timeout")

// Timeout returns middleware that gives each message at most d: the inner
// chain's context gets a deadline d from now. When that deadline (and not the
// caller's context) ended a failing handler, the error becomes a
// timeout error: transient, retried with OutcomeTimeout. A handler that
// returns nil after the deadline still succeeded.
//
// The handler must honour its context; Timeout does not abandon a handler
// that ignores it (that would leak the goroutine and break Dedup's lease).
// d <= 0 disables the timeout.
func Timeout(d time.Duration) Middleware {
	return func(next Handler) Handler {
		if d <= 0 {
			return next
		}
		return HandlerFunc(func(ctx context.Context, msg *Message) error {
			tctx, cancel := context.WithTimeoutCause(ctx, d, errTimeout)
			defer cancel()
			err := next.Handle(tctx, msg)
			if err != nil && ctx.Err() == nil && errors.Is(context.Cause(tctx), errTimeout) {
				return &timeoutError{Timeout: d, Err: err}
			}
			return err
		})
	}
}
