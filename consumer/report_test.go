package consumer_test

import (
	"context"
	"errors"
	"testing"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
)

// TestResultOutcomeOfADeadLetterIsItsReason: whatever poison Decide
// dead-letters, the Outcome an adapter reports is the reason it writes
// with the dead letter.
func TestResultOutcomeOfADeadLetterIsItsReason(t *testing.T) {
	n := 0
	for _, c := range decideCases() {
		r := consumer.Decide(c.err)
		if r.Action != consumer.ActionDeadLetter && !r.DeadLettered {
			continue
		}
		n++
		if got := r.Outcome(); got != r.Reason {
			t.Errorf("%s: Outcome() = %q, the dead letter's reason is %q", c.name, got, r.Reason)
		}
	}
	if n == 0 {
		t.Fatal("no dead-letter case among decideCases")
	}
	// An adapter's own reason (a redelivery limit) is reported as well.
	own := consumer.Result{Action: consumer.ActionDeadLetter, Reason: "redelivery_limit", Err: errBoom}
	if got := own.Outcome(); got != "redelivery_limit" {
		t.Errorf("adapter reason: Outcome() = %q, want redelivery_limit", got)
	}
}

// TestResultOutcome: the outcomes of the verdicts that are not dead
// letters.
func TestResultOutcome(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		want consumer.Outcome
	}{
		{"success", nil, consumer.OutcomeCompleted},
		{"duplicate", dedup.ErrDuplicate, consumer.OutcomeDuplicate},
		{"in flight", dedup.ErrInFlight, consumer.OutcomeInFlight},
		{"lease lost", dedup.ErrLeaseLost, consumer.OutcomeLeaseLost},
		{"transient handler error", errBoom, consumer.OutcomeFailed},
	} {
		if got := consumer.Decide(c.err).Outcome(); got != c.want {
			t.Errorf("%s: Outcome() = %q, want %q", c.name, got, c.want)
		}
	}
}

// TestDeadLetterHookReasonIsTheOutcome: the reason the DeadLetter
// middleware hands its hook is the Outcome the adapter reports for the
// parked message.
func TestDeadLetterHookReasonIsTheOutcome(t *testing.T) {
	for _, cause := range []error{
		consumer.Permanent(errBoom),
		&consumer.PanicError{Value: "x"},
		&consumer.RetriesExhaustedError{Attempts: 3, Err: errBoom},
		consumer.Permanent(dedup.ErrFingerprintMismatch),
	} {
		var hookReason consumer.Outcome
		dl := mustDeadLetter(t, func(_ context.Context, _ *consumer.Message, reason consumer.Outcome, _ error) error {
			hookReason = reason
			return nil
		})
		err := dl(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return cause })).Handle(context.Background(), msg("1", "p"))
		r := consumer.Decide(err)
		if !r.DeadLettered {
			t.Fatalf("%v: not dead-lettered: %+v", cause, r)
		}
		if got := r.Outcome(); got != hookReason || got == consumer.OutcomeFailed {
			t.Errorf("%v: Outcome() = %q, the hook got %q", cause, got, hookReason)
		}
		if !errors.Is(err, errBoom) && hookReason != consumer.OutcomePanic && hookReason != consumer.OutcomeFingerprintMismatch {
			t.Errorf("%v: the error %v lost its cause", cause, err)
		}
	}
}
