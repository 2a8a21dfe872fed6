package consumer_test

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
)

func TestRecover(t *testing.T) {
	for name, v := range map[string]any{"string": "boom", "error": errBoom, "duplicate error": dedup.ErrDuplicate} {
		t.Run(name, func(t *testing.T) {
			h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { panic(v) }), consumer.Recover())
			r := consumer.Process(t.Context(), h, msg("m1", "p"))
			wantResult(t, r, consumer.ActionDeadLetter, consumer.OutcomePanic)
			var pe *consumer.PanicError
			if !errors.As(r.Err, &pe) || pe.Value != v || len(pe.Stack) == 0 || !strings.Contains(pe.Error(), "panicked") {
				t.Fatalf("err %v, want a PanicError carrying %v", r.Err, v)
			}
		})
	}
	ok := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return errBoom }), consumer.Recover())
	if err := ok.Handle(t.Context(), msg("m1", "p")); err != errBoom {
		t.Fatalf("Recover changed a plain error: %v", err)
	}
}

func TestTimeout(t *testing.T) {
	blocking := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		<-ctx.Done()
		return ctx.Err()
	})
	t.Run("deadline fires", func(t *testing.T) {
		r := consumer.Process(t.Context(), consumer.Chain(blocking, consumer.Timeout(5*time.Millisecond)), msg("m1", "p"))
		wantResult(t, r, consumer.ActionRetry, consumer.OutcomeTimeout)
		var te *consumer.TimeoutError
		if !errors.As(r.Err, &te) || te.Timeout != 5*time.Millisecond || !errors.Is(r.Err, context.DeadlineExceeded) {
			t.Fatalf("err %v, want a TimeoutError wrapping DeadlineExceeded", r.Err)
		}
	})
	t.Run("permanent after the deadline is a timeout", func(t *testing.T) {
		h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			<-ctx.Done()
			return consumer.Permanent(ctx.Err())
		}), consumer.Timeout(time.Millisecond))
		wantResult(t, consumer.Process(t.Context(), h, msg("m1", "p")), consumer.ActionRetry, consumer.OutcomeTimeout)
	})
	t.Run("parent cancelled", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			cancel()
			<-ctx.Done()
			return ctx.Err()
		}), consumer.Timeout(time.Hour))
		r := consumer.Process(ctx, h, msg("m1", "p"))
		wantResult(t, r, consumer.ActionRetry, consumer.OutcomeTransient)
		var te *consumer.TimeoutError
		if errors.As(r.Err, &te) {
			t.Fatal("a cancelled parent was reported as a timeout")
		}
	})
	t.Run("parent deadline", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), time.Millisecond)
		defer cancel()
		r := consumer.Process(ctx, consumer.Chain(blocking, consumer.Timeout(time.Hour)), msg("m1", "p"))
		wantResult(t, r, consumer.ActionRetry, consumer.OutcomeTransient)
	})
	t.Run("success after the deadline", func(t *testing.T) {
		h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			<-ctx.Done()
			return nil
		}), consumer.Timeout(time.Millisecond))
		wantResult(t, consumer.Process(t.Context(), h, msg("m1", "p")), consumer.ActionAck, "")
	})
	t.Run("disabled", func(t *testing.T) {
		h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			if _, ok := ctx.Deadline(); ok {
				return errors.New("deadline set")
			}
			return nil
		}), consumer.Timeout(0))
		wantResult(t, consumer.Process(t.Context(), h, msg("m1", "p")), consumer.ActionAck, "")
	})
	t.Run("with retry it is retried then dead-lettered", func(t *testing.T) {
		calls := 0
		h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			calls++
			return blocking(ctx, m)
		}), mustRetry(t, consumer.RetryOptions{MaxAttempts: 3, Sleep: noSleep}), consumer.Timeout(time.Millisecond))
		wantResult(t, consumer.Process(t.Context(), h, msg("m1", "p")), consumer.ActionDeadLetter, consumer.OutcomeRetriesExhausted)
		if calls != 3 {
			t.Fatalf("calls = %d, want 3", calls)
		}
	})
}

type dlCall struct {
	msg    *consumer.Message
	reason consumer.Outcome
	cause  error
	ctxErr error
}

func TestDeadLetter(t *testing.T) {
	var calls []dlCall
	var hookErr error
	dl := mustDeadLetter(t, func(ctx context.Context, m *consumer.Message, reason consumer.Outcome, cause error) error {
		calls = append(calls, dlCall{m, reason, cause, ctx.Err()})
		return hookErr
	})
	returning := func(err error) consumer.Handler {
		return consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return err }), dl)
	}

	t.Run("parks and acks", func(t *testing.T) {
		calls = nil
		m := msg("m1", "p")
		r := consumer.Process(t.Context(), returning(consumer.Permanent(errBoom)), m)
		if r.Action != consumer.ActionAck || !r.DeadLettered || r.Reason != consumer.OutcomePermanent || r.Duplicate {
			t.Fatalf("result %+v, want ack dead-lettered permanent", r)
		}
		var dle *consumer.DeadLetteredError
		if !errors.As(r.Err, &dle) || dle.Reason != consumer.OutcomePermanent || !errors.Is(r.Err, errBoom) {
			t.Fatalf("err %v, want a DeadLetteredError wrapping errBoom", r.Err)
		}
		if len(calls) != 1 || calls[0].msg != m || calls[0].reason != consumer.OutcomePermanent || !errors.Is(calls[0].cause, errBoom) || calls[0].ctxErr != nil {
			t.Fatalf("hook calls %+v", calls)
		}
	})
	t.Run("hook failure is retried, not lost", func(t *testing.T) {
		calls, hookErr = nil, io.ErrClosedPipe
		defer func() { hookErr = nil }()
		r := consumer.Process(t.Context(), returning(&dedup.ClaimError{Err: dedup.ErrFingerprintMismatch, Key: dedup.Key{Scope: "s", ID: "i"}}), msg("m1", "p"))
		wantResult(t, r, consumer.ActionRetry, consumer.OutcomeTransient)
		if !errors.Is(r.Err, io.ErrClosedPipe) || !errors.Is(r.Err, dedup.ErrFingerprintMismatch) || len(calls) != 1 {
			t.Fatalf("err %v calls %d, want both errors wrapped and one hook call", r.Err, len(calls))
		}
	})
	t.Run("not while stopping", func(t *testing.T) {
		calls = nil
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		h := returning(consumer.Permanent(errBoom))
		err := h.Handle(ctx, msg("m1", "p"))
		wantResult(t, consumer.Decide(err), consumer.ActionRetry, consumer.OutcomeTransient)
		if len(calls) != 0 {
			t.Fatal("hook called while the consumer was stopping")
		}
	})
	t.Run("passes the rest through", func(t *testing.T) {
		calls = nil
		for _, err := range []error{nil, errBoom, dedup.ErrDuplicate, dedup.ErrInFlight} {
			if got := returning(err).Handle(t.Context(), msg("m1", "p")); got != err {
				t.Errorf("DeadLetter changed %v into %v", err, got)
			}
		}
		if len(calls) != 0 {
			t.Fatalf("hook called %d times for errors that are not dead", len(calls))
		}
	})
	t.Run("every dead reason", func(t *testing.T) {
		for _, c := range []struct {
			err    error
			reason consumer.Outcome
		}{
			{consumer.Permanent(&consumer.PanicError{Value: 1}), consumer.OutcomePanic},
			{dedup.ErrInvalidKey, consumer.OutcomeInvalidKey},
			{&consumer.RetriesExhaustedError{Attempts: 2, Err: errBoom}, consumer.OutcomeRetriesExhausted},
		} {
			calls = nil
			r := consumer.Process(t.Context(), returning(c.err), msg("m1", "p"))
			if !r.DeadLettered || r.Reason != c.reason || len(calls) != 1 || calls[0].reason != c.reason {
				t.Errorf("%v: result %+v calls %+v, want dead-lettered %s", c.err, r, calls, c.reason)
			}
		}
	})
	t.Run("hook gets a context that survives the stop", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		var hookCtxErr error
		dl := mustDeadLetter(t, func(hctx context.Context, _ *consumer.Message, _ consumer.Outcome, _ error) error {
			cancel() // the consumer starts stopping while the hook publishes
			hookCtxErr = hctx.Err()
			if _, ok := hctx.Deadline(); !ok {
				return errors.New("hook context has no deadline")
			}
			return nil
		})
		h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return consumer.Permanent(errBoom) }), dl)
		if err := h.Handle(ctx, msg("m1", "p")); !consumer.Decide(err).DeadLettered || hookCtxErr != nil {
			t.Fatalf("err %v hook ctx err %v, want dead-lettered with a live hook context", err, hookCtxErr)
		}
	})
	if mw, err := consumer.DeadLetter(nil); err == nil || mw != nil || !strings.Contains(err.Error(), "hook") {
		t.Fatalf("DeadLetter(nil) = %v, want an error naming the hook", err)
	}
}
