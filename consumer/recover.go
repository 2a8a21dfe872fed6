package consumer

import (
	"context"
	"runtime/debug"
)

// Recover returns middleware that turns a panic in the inner chain into
// Permanent(&PanicError{...}): the panic is treated as a poison message,
// dead-lettered with OutcomePanic rather than retried, since a handler that
// panics on a message will panic on every redelivery of it. The stack is
// kept in the PanicError for the logs.
//
// Put Recover inside Retry (so Retry sees an error, not a panic) and outside
// Dedup (Dedup releases the lease while the panic passes through it).
func Recover() Middleware {
	return func(next Handler) Handler {
		return HandlerFunc(func(ctx context.Context, msg *Message) (err error) {
			defer func() {
				if v := recover(); v != nil {
					err = Permanent(&PanicError{Value: v, Stack: debug.Stack()})
				}
			}()
			return next.Handle(ctx, msg)
		})
	}
}
