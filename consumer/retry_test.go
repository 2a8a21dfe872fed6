package consumer_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
)

// recordSleep is a RetryOptions.Sleep that records the delays and does not
// sleep.
type recordSleep struct{ delays []time.Duration }

func (r *recordSleep) sleep(ctx context.Context, d time.Duration) error {
	r.delays = append(r.delays, d)
	return ctx.Err()
}

func TestRetryExhaustsWithFullJitter(t *testing.T) {
	const (
		attempts = 8
		initial  = 10 * time.Millisecond
		maxDelay = 200 * time.Millisecond
	)
	for _, jitter := range []struct {
		name string
		fn   func(time.Duration) time.Duration
	}{
		{"default", nil},
		{"top", func(n time.Duration) time.Duration { return n - 1 }},
		{"bottom", func(time.Duration) time.Duration { return 0 }},
	} {
		t.Run(jitter.name, func(t *testing.T) {
			rec := &recordSleep{}
			var seen []int
			h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				seen = append(seen, consumer.RetryAttempt(ctx))
				return errBoom
			}), mustRetry(t, consumer.RetryOptions{MaxAttempts: attempts, Backoff: consumer.Backoff{Initial: initial, Max: maxDelay}, Jitter: jitter.fn, Sleep: rec.sleep}))
			m := msg("m1", "p")
			r := consumer.Process(t.Context(), h, m)
			wantResult(t, r, consumer.ActionDeadLetter, consumer.OutcomeRetriesExhausted)
			var ex *consumer.RetriesExhaustedError
			if !errors.As(r.Err, &ex) || ex.Attempts != attempts || !errors.Is(r.Err, errBoom) {
				t.Fatalf("err %v, want RetriesExhaustedError{%d} wrapping errBoom", r.Err, attempts)
			}
			if len(seen) != attempts || seen[0] != 1 || seen[attempts-1] != attempts {
				t.Fatalf("RetryAttempt per attempt = %v, want 1..%d", seen, attempts)
			}
			if m.Attempt != 1 {
				t.Fatalf("Message.Attempt changed to %d; Retry must leave it alone", m.Attempt)
			}
			if len(rec.delays) != attempts-1 {
				t.Fatalf("%d sleeps, want %d", len(rec.delays), attempts-1)
			}
			for i, d := range rec.delays {
				ceil := min(maxDelay, initial<<i)
				if d < 0 || d >= ceil {
					t.Errorf("delay %d = %v, want in [0, %v)", i+1, d, ceil)
				}
				switch jitter.name {
				case "top":
					if d != ceil-1 {
						t.Errorf("delay %d = %v, want the cap %v minus 1", i+1, d, ceil)
					}
				case "bottom":
					if d != 0 {
						t.Errorf("delay %d = %v, want 0", i+1, d)
					}
				}
			}
		})
	}
}

func TestRetrySucceedsAfterTransient(t *testing.T) {
	calls := 0
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		calls++
		if calls < 3 {
			return errBoom
		}
		return nil
	}), mustRetry(t, consumer.RetryOptions{Sleep: noSleep}))
	wantResult(t, consumer.Process(t.Context(), h, msg("m1", "p")), consumer.ActionAck, "")
	if calls != 3 {
		t.Fatalf("calls = %d, want 3", calls)
	}
}

func TestRetryDoesNotRetryPermanent(t *testing.T) {
	key := dedup.Key{Scope: "s", ID: "i"}
	for name, c := range map[string]struct {
		err    error
		action consumer.Action
		reason consumer.Outcome
	}{
		"permanent":   {consumer.Permanent(errBoom), consumer.ActionDeadLetter, consumer.OutcomePermanent},
		"duplicate":   {&dedup.ClaimError{Err: dedup.ErrDuplicate, Key: key}, consumer.ActionAck, consumer.OutcomeDuplicate},
		"mismatch":    {&dedup.ClaimError{Err: dedup.ErrFingerprintMismatch, Key: key}, consumer.ActionDeadLetter, consumer.OutcomeFingerprintMismatch},
		"invalid key": {dedup.ErrInvalidKey, consumer.ActionDeadLetter, consumer.OutcomeInvalidKey},
		"panic":       {consumer.Permanent(&consumer.PanicError{Value: 1}), consumer.ActionDeadLetter, consumer.OutcomePanic},
	} {
		t.Run(name, func(t *testing.T) {
			calls := 0
			h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
				calls++
				return c.err
			}), mustRetry(t, consumer.RetryOptions{Sleep: noSleep}))
			r := consumer.Process(t.Context(), h, msg("m1", "p"))
			wantResult(t, r, c.action, c.reason)
			if calls != 1 || r.Err != c.err {
				t.Fatalf("calls=%d err=%v; want one call and the error unchanged", calls, r.Err)
			}
		})
	}
}

// An in-flight error's RetryAfter is a lower bound on the delay, capped by
// Max; exhausting the attempts on in-flight errors stays a retry.
func TestRetryInFlight(t *testing.T) {
	for _, c := range []struct {
		after, want time.Duration
	}{
		{3 * time.Second, 3 * time.Second},
		{time.Hour, 10 * time.Second},
	} {
		rec := &recordSleep{}
		h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
			return &dedup.ClaimError{Err: dedup.ErrInFlight, Key: dedup.Key{Scope: "s", ID: "i"}, RetryAfter: c.after}
		}), mustRetry(t, consumer.RetryOptions{MaxAttempts: 3, Backoff: consumer.Backoff{Initial: time.Millisecond}, Sleep: rec.sleep}))
		r := consumer.Process(t.Context(), h, msg("m1", "p"))
		wantResult(t, r, consumer.ActionRetry, consumer.OutcomeInFlight)
		var ex *consumer.RetriesExhaustedError
		if !errors.As(r.Err, &ex) || r.RetryAfter != c.after {
			t.Fatalf("err %v RetryAfter %v, want exhausted and %v", r.Err, r.RetryAfter, c.after)
		}
		if len(rec.delays) != 2 || rec.delays[0] != c.want || rec.delays[1] != c.want {
			t.Fatalf("delays %v, want two of %v", rec.delays, c.want)
		}
	}
}

func TestRetryStopsOnCancel(t *testing.T) {
	t.Run("during the handler", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		calls := 0
		h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			calls++
			cancel()
			return consumer.Permanent(ctx.Err()) // Permanent must not leak through a stop
		}), mustRetry(t, consumer.RetryOptions{ShouldRetry: func(error) bool { return true }, Sleep: noSleep}))
		r := consumer.Process(ctx, h, msg("m1", "p"))
		wantResult(t, r, consumer.ActionRetry, consumer.OutcomeTransient)
		if calls != 1 || !errors.Is(r.Err, context.Canceled) {
			t.Fatalf("calls=%d err=%v; want one call and context.Canceled", calls, r.Err)
		}
	})
	t.Run("during the sleep", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		calls := 0
		h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
			calls++
			return errBoom
		}), mustRetry(t, consumer.RetryOptions{Backoff: consumer.Backoff{Initial: time.Hour, Max: time.Hour}, Jitter: func(n time.Duration) time.Duration { return n - 1 },
			Sleep: func(ctx context.Context, d time.Duration) error {
				cancel()
				<-ctx.Done()
				return ctx.Err()
			}}))
		r := consumer.Process(ctx, h, msg("m1", "p"))
		wantResult(t, r, consumer.ActionRetry, consumer.OutcomeTransient)
		if calls != 1 || !errors.Is(r.Err, context.Canceled) || errors.As(r.Err, new(*consumer.RetriesExhaustedError)) {
			t.Fatalf("calls=%d err=%v; want one call and context.Canceled", calls, r.Err)
		}
	})
	t.Run("default sleep", func(t *testing.T) {
		// The real timer: an hour-long backoff ends as soon as ctx is
		// cancelled.
		ctx, cancel := context.WithCancel(t.Context())
		h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
			time.AfterFunc(time.Millisecond, cancel)
			return errBoom
		}), mustRetry(t, consumer.RetryOptions{Backoff: consumer.Backoff{Initial: time.Hour, Max: time.Hour}, Jitter: func(n time.Duration) time.Duration { return n - 1 }}))
		r := consumer.Process(ctx, h, msg("m1", "p"))
		wantResult(t, r, consumer.ActionRetry, consumer.OutcomeTransient)
		if !errors.Is(r.Err, context.Canceled) {
			t.Fatalf("err %v, want context.Canceled", r.Err)
		}
	})
}

func TestRetryShouldRetry(t *testing.T) {
	calls := 0
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		calls++
		return errBoom
	}), mustRetry(t, consumer.RetryOptions{ShouldRetry: func(err error) bool { return false }, Sleep: noSleep}))
	wantResult(t, consumer.Process(t.Context(), h, msg("m1", "p")), consumer.ActionRetry, consumer.OutcomeTransient)
	if calls != 1 {
		t.Fatalf("calls = %d, want 1", calls)
	}
}

// Each retry re-claims after the failed attempt released the key.
func TestRetryAroundDedupReclaims(t *testing.T) {
	cs := &countingStore{LeaseStore: newStore(t, memstore.Options{})}
	var fx effects
	calls := 0
	h := consumer.Chain(consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		calls++
		if calls < 3 {
			return errBoom
		}
		fx.add(m.ID)
		return nil
	}), mustRetry(t, consumer.RetryOptions{Sleep: noSleep}), consumer.Recover(), mustDedup(t, cs, consumer.DedupOptions{}))
	wantResult(t, consumer.Process(t.Context(), h, msg("m1", "p")), consumer.ActionAck, "")
	if cs.claims.Load() != 3 || cs.releases.Load() != 2 || cs.completes.Load() != 1 || fx.counts()["m1"] != 1 {
		t.Fatalf("claims=%d releases=%d completes=%d effects=%d; want 3, 2, 1, 1",
			cs.claims.Load(), cs.releases.Load(), cs.completes.Load(), fx.counts()["m1"])
	}
	if consumer.RetryAttempt(t.Context()) != 0 {
		t.Fatal("RetryAttempt outside Retry is not 0")
	}
}

func TestRetryOptionErrors(t *testing.T) {
	for name, o := range map[string]consumer.RetryOptions{
		"MaxAttempts": {MaxAttempts: -1},
		"Initial":     {Backoff: consumer.Backoff{Initial: -1}},
		"Max":         {Backoff: consumer.Backoff{Max: -1}},
		"Factor":      {Backoff: consumer.Backoff{Factor: 0.5}},
		"greater":     {Backoff: consumer.Backoff{Initial: time.Minute, Max: time.Second}},
	} {
		mw, err := consumer.Retry(o)
		if err == nil || mw != nil || !strings.Contains(err.Error(), strings.TrimSuffix(name, "greater")) {
			t.Errorf("%s: Retry = %v, want an error", name, err)
		}
	}
}

func TestRetryLargeBackoffDoesNotOverflow(t *testing.T) {
	rec := &recordSleep{}
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return errBoom }),
		mustRetry(t, consumer.RetryOptions{MaxAttempts: 100, Backoff: consumer.Backoff{Initial: time.Second, Max: 1<<63 - 1},
			Jitter: func(n time.Duration) time.Duration { return n - 1 }, Sleep: rec.sleep}))
	consumer.Process(t.Context(), h, msg("m1", "p"))
	for i := 1; i < len(rec.delays); i++ {
		if rec.delays[i] < rec.delays[i-1] {
			t.Fatalf("delay %d (%v) shrank after %v: overflow", i, rec.delays[i], rec.delays[i-1])
		}
	}
}
