package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// deadLetterTimeout bounds the hook. The hook runs with
// context.WithoutCancel, so a stop that begins while it runs does not abort a
// publish that is nearly done.
const deadLetterTimeout = 30 * time.Second

// DeadLetter returns middleware that hands dead messages to hook, which parks
// a message that will never succeed: it publishes it to a dead-letter topic or
// queue, or writes it to a table; reason and cause say why. The hook returns
// nil only once the message is safely stored, because the message is
// acknowledged right after.
//
// When Decide
// classifies the inner chain's error as ActionDeadLetter (a Permanent error,
// a panic, a fingerprint mismatch, an invalid key, exhausted retries), it
// calls hook, and then:
//
//   - hook returned nil: DeadLetter returns an error that Decide
//     acknowledges (Result.DeadLettered, Reason kept);
//   - hook failed: DeadLetter returns a transient error wrapping both the
//     hook's error and the cause; the message is not acknowledged, so it is
//     never lost, and the redelivery tries again.
//
// While ctx is done (the consumer is stopping) the hook is not called and
// the error is transient too: an error that arrives during a stop may be a
// consequence of it, and the redelivery classifies it again.
//
// The hook gets context.WithoutCancel(ctx) with a 30s timeout. Other errors,
// and nil, pass through unchanged. Put DeadLetter outermost, so it sees the
// error after Retry gave up.
func DeadLetter(hook func(ctx context.Context, msg *Message, reason Outcome, cause error) error) (Middleware, error) {
	if hook == nil {
		return nil, errors.New("consumer: DeadLetter: hook is nil; without a place to park dead messages, leave DeadLetter out and let the adapter act on ActionDeadLetter")
	}
	return func(next Handler) Handler {
		return HandlerFunc(func(ctx context.Context, msg *Message) error {
			err := next.Handle(ctx, msg)
			if err == nil {
				return nil
			}
			r := Decide(err)
			if r.Action != ActionDeadLetter {
				return err
			}
			if cerr := ctx.Err(); cerr != nil {
				return &deadLetterFailedError{reason: r.Reason, cause: err, why: fmt.Errorf("consumer is stopping: %w", cerr)}
			}
			hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), deadLetterTimeout)
			defer cancel()
			if herr := hook(hctx, msg, r.Reason, err); herr != nil {
				return &deadLetterFailedError{reason: r.Reason, cause: err, why: fmt.Errorf("dead-letter hook: %w", herr)}
			}
			return &deadLetteredError{Reason: r.Reason, Err: err}
		})
	}, nil
}
