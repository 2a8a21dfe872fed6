package txflow

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/telemetry"
)

// TestResult: the handler outcome and the claim verdict of each way a run
// ends.
func TestResult(t *testing.T) {
	t.Parallel()
	key := dedup.Key{Scope: "s", ID: "1"}
	herr := errors.New("handler failed")
	commit := errors.New("commit failed")
	dup := &dedup.ClaimError{Err: dedup.ErrDuplicate, Key: key}
	cases := []struct {
		name    string
		r       Result
		handled string
		verdict error
	}{
		{"committed", Result{Ran: true}, telemetry.HandledCompleted, nil},
		{"handler failed", Result{Ran: true, HandlerErr: herr, Err: herr}, telemetry.HandledReleased, nil},
		{"commit failed", Result{Ran: true, Err: commit}, telemetry.HandledCompleteFailed, nil},
		{"taken by a claim that does not wait", Result{Ran: true, Err: dup}, telemetry.HandledReleased, dup},
		{"duplicate", Result{Err: dup}, telemetry.HandledReleased, dup},
		{"store down", Result{Err: commit}, telemetry.HandledCompleteFailed, commit},
	}
	for _, c := range cases {
		if c.r.Ran {
			if got := c.r.Handled(); got != c.handled {
				t.Errorf("%s: Handled() = %q, want %q", c.name, got, c.handled)
			}
		}
		if got := c.r.Verdict(); !errors.Is(got, c.verdict) || (c.verdict == nil) != (got == nil) {
			t.Errorf("%s: Verdict() = %v, want %v", c.name, got, c.verdict)
		}
	}
}

func TestHeld(t *testing.T) {
	t.Parallel()
	k := dedup.Key{Scope: "s", ID: "i"}
	for _, c := range []struct {
		err  error
		want bool
	}{
		{&dedup.ClaimError{Err: dedup.ErrDuplicate, Key: k, Result: []byte("r")}, true},
		{&dedup.ClaimError{Err: dedup.ErrInFlight, Key: k, RetryAfter: time.Second}, true},
		{&dedup.ClaimError{Err: dedup.ErrFingerprintMismatch, Key: k}, true},
		{fmt.Errorf("pgtable: commit: %w", &dedup.ClaimError{Err: dedup.ErrDuplicate, Key: k}), true},
		{nil, false},
		{dedup.ErrLeaseLost, false},
		{dedup.ErrInvalidKey, false},
		{dedup.ErrClosed, false},
		{context.DeadlineExceeded, false},
		{errors.New("connection refused"), false},
	} {
		if got := Held(c.err); got != c.want {
			t.Errorf("Held(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
