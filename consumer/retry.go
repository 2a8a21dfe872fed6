package consumer

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/internal/defaults"
	"github.com/idemkit/idem/internal/telemetry"
)

// RetryOptions configure the Retry middleware. The zero value is usable.
type RetryOptions struct {
	// MaxAttempts is the number of attempts, the first included. Defaults
	// to 5; 1 means no retry.
	MaxAttempts int
	// Backoff caps the delay before each retry (Backoff.Delay; the
	// delay is drawn below it, see Jitter); Backoff.Max also caps a
	// RetryAfter hint. Defaults to Initial 100ms, Max 10s, Factor 2.
	Backoff Backoff
	// ShouldRetry reports whether an error is worth another attempt.
	// Defaults to Decide(err).Action == ActionRetry: transient errors,
	// timeouts, dedup.ErrInFlight and dedup.ErrLeaseLost are retried;
	// Permanent errors, panics, duplicates, fingerprint mismatches and
	// invalid keys are not.
	ShouldRetry func(error) bool
	// Jitter returns a random duration in [0, n) for n > 0. Defaults to a
	// uniform draw (math/rand/v2). Tests inject their own.
	Jitter func(n time.Duration) time.Duration
	// Sleep waits for d or until ctx is done, returning ctx's error then.
	// Defaults to a timer. Tests inject their own.
	Sleep func(ctx context.Context, d time.Duration) error
	// MeterProvider receives idem.lease.wait.duration: for each message
	// that found its key in flight elsewhere, the time slept waiting for
	// the other owner, with how the wait ended (acquired, duplicate,
	// gave_up). Defaults to otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
}

// defaultRetryBackoff is RetryOptions.Backoff's default.
var defaultRetryBackoff = Backoff{Initial: 100 * time.Millisecond, Max: 10 * time.Second, Factor: 2}

// Retry returns middleware that retries the handler in process, with
// exponential backoff and full jitter: before retry n (n = 1, 2, ...) it
// sleeps a uniform random duration in [0, Backoff.Delay(n)). When the
// error carries a RetryAfter hint (dedup.ErrInFlight: the other owner's
// lease has that long left), the sleep is at least the hint, still capped by
// Backoff.Max.
//
// It stops and returns when:
//
//   - the handler succeeds (nil);
//   - the error is not retryable (returned unchanged, to be acknowledged as
//     a duplicate or dead-lettered);
//   - ctx is done (an error wrapping ctx.Err(): transient, no ACK — the
//     consumer is stopping);
//   - MaxAttempts attempts failed: a *RetriesExhaustedError wrapping
//     the last error, which Decide dead-letters
//     (OutcomeRetriesExhausted) — unless the last error was
//     dedup.ErrInFlight or dedup.ErrLeaseLost, which stay retries: another
//     consumer owns the message, it is not poison.
//
// Each attempt runs the whole inner chain again, so put Dedup inside Retry:
// a failed attempt releases the key and the next attempt claims it afresh.
// Message.Attempt is left alone (it counts broker deliveries); the
// in-process attempt is RetryAttempt(ctx).
func Retry(opts RetryOptions) (Middleware, error) {
	c := defaults.New("consumer: Retry: RetryOptions")
	c.Int("MaxAttempts", &opts.MaxAttempts, 5)
	var err error
	opts.Backoff, err = opts.Backoff.WithDefaults(defaultRetryBackoff)
	c.Wrap("Backoff", err)
	if err := c.Err(); err != nil {
		return nil, err
	}
	if opts.ShouldRetry == nil {
		opts.ShouldRetry = func(err error) bool { return Decide(err).Action == ActionRetry }
	}
	if opts.Jitter == nil {
		opts.Jitter = rand.N[time.Duration]
	}
	if opts.Sleep == nil {
		opts.Sleep = sleep
	}
	wait := telemetry.NewLeaseWait(opts.MeterProvider)
	return func(next Handler) Handler {
		return HandlerFunc(func(ctx context.Context, msg *Message) error {
			return retry(ctx, msg, next, &opts, wait)
		})
	}, nil
}

func retry(ctx context.Context, msg *Message, next Handler, o *RetryOptions, wait *telemetry.LeaseWait) (err error) {
	var waited time.Duration // slept because the key was in flight elsewhere
	defer func() {
		if waited > 0 {
			outcome := "gave_up"
			switch {
			case err == nil:
				outcome = "acquired"
			case errors.Is(err, dedup.ErrDuplicate):
				outcome = "duplicate"
			}
			wait.Record(ctx, "", outcome, waited)
		}
	}()
	for attempt := 1; ; attempt++ {
		err := next.Handle(context.WithValue(ctx, attemptKey{}, attempt), msg)
		if err == nil || !o.ShouldRetry(err) {
			return err
		}
		if cerr := ctx.Err(); cerr != nil {
			return stopped(cerr, attempt, err)
		}
		if attempt >= o.MaxAttempts {
			return &RetriesExhaustedError{Attempts: attempt, Err: err}
		}
		d := o.backoff(attempt)
		if hint := Decide(err).RetryAfter; hint > d {
			d = min(hint, o.Backoff.Max)
		}
		slept := time.Now()
		serr := o.Sleep(ctx, d)
		if errors.Is(err, dedup.ErrInFlight) {
			waited += time.Since(slept)
		}
		if serr != nil {
			return stopped(serr, attempt, err)
		}
	}
}

// backoff returns the full-jitter delay before retry n (n >= 1).
func (o *RetryOptions) backoff(n int) time.Duration {
	ceil := o.Backoff.Delay(n)
	if ceil <= 0 {
		return 0
	}
	return o.Jitter(ceil)
}

// stopped is the error of a Retry that stopped early because of cause
// (ctx's error). It wraps cause only: the last attempt's error is kept as
// text, so that the stop is transient whatever that error was.
func stopped(cause error, attempt int, last error) error {
	return fmt.Errorf("consumer: retry stopped after attempt %d: %w (last error: %s)", attempt, cause, last.Error())
}

func sleep(ctx context.Context, d time.Duration) error {
	if !backoff.Sleep(ctx, d) {
		return ctx.Err()
	}
	return nil
}

type attemptKey struct{}

// RetryAttempt returns the in-process attempt of the innermost Retry
// middleware around the caller, 1-based, or 0 outside Retry.
func RetryAttempt(ctx context.Context) int {
	n, _ := ctx.Value(attemptKey{}).(int)
	return n
}
