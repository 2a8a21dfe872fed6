package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
)

// FuzzDecide builds error chains from the fuzzer's bytes — wrapping,
// Permanent marks, joins, middleware error types around the sentinels — and
// checks Decide's invariants: it never panics, the Action is valid, only
// nil, duplicates and dead-lettered errors are acknowledged, and
// ownership errors are never dead-lettered.
func FuzzDecide(f *testing.F) {
	f.Add([]byte{0})
	f.Add([]byte{1, 7})
	f.Add([]byte{3, 9, 2})
	f.Add([]byte{4, 5, 8, 6, 1})
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) > 64 {
			ops = ops[:64]
		}
		key := dedup.Key{Scope: "s", ID: "i"}
		leaves := []error{
			nil, errors.New("x"), dedup.ErrDuplicate, &dedup.ClaimError{Err: dedup.ErrInFlight, Key: key, RetryAfter: time.Second}, dedup.ErrLeaseLost,
			&dedup.ClaimError{Err: dedup.ErrFingerprintMismatch, Key: key}, dedup.ErrInvalidKey, context.Canceled, context.DeadlineExceeded, dedup.ErrClosed,
		}
		var err error
		for i, op := range ops {
			switch op % 8 {
			case 0:
				err = leaves[int(op/8)%len(leaves)]
			case 1:
				err = consumer.Permanent(err)
			case 2:
				if err != nil {
					err = fmt.Errorf("w%d: %w", i, err)
				}
			case 3:
				err = errors.Join(err, leaves[int(op/8)%len(leaves)])
			case 4:
				if err != nil {
					err = &consumer.RetriesExhaustedError{Attempts: i, Err: err}
				}
			case 5:
				if err != nil {
					err = &consumer.TimeoutError{Timeout: time.Second, Err: err}
				}
			case 6:
				err = consumer.Permanent(&consumer.PanicError{Value: op})
			case 7:
				if err != nil {
					err = &consumer.DeadLetteredError{Reason: consumer.OutcomePermanent, Err: err}
				}
			}
		}
		r := consumer.Decide(err)
		if r.Err != err {
			t.Fatalf("Result.Err = %v, want the input", r.Err)
		}
		switch r.Action {
		case consumer.ActionAck:
			var dl *consumer.DeadLetteredError
			if err != nil && !errors.Is(err, dedup.ErrDuplicate) && !errors.As(err, &dl) {
				t.Fatalf("Decide acked %v", err)
			}
		case consumer.ActionRetry, consumer.ActionDeadLetter:
			if err == nil || r.Reason == "" {
				t.Fatalf("Decide(%v) = %+v: a failure without a reason", err, r)
			}
		default:
			t.Fatalf("Decide(%v) = invalid action %v", err, r.Action)
		}
		if r.Action == consumer.ActionDeadLetter && (errors.Is(err, dedup.ErrInFlight) || errors.Is(err, dedup.ErrLeaseLost)) {
			t.Fatalf("Decide dead-lettered an ownership error: %v", err)
		}
	})
}

// FuzzKey feeds arbitrary ids through Dedup's key building: an id the dedup
// key model rejects is dead-lettered as invalid_key without asking the store;
// any other id reaches the store.
func FuzzKey(f *testing.F) {
	for _, s := range []string{"", "order-1", "a\x00b", "\xff", "ünï", "a\u0085b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, id string) {
		var claimed dedup.Key
		store := stubLeaseStore{claim: func(k dedup.Key) { claimed = k }}
		mw, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "s"})
		if err != nil {
			t.Fatal(err)
		}
		h := mw(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
		r := consumer.Process(context.Background(), h, &consumer.Message{ID: id, Payload: []byte(id)})
		valid := dedup.ValidateKey(dedup.Key{Scope: "s", ID: id}, 0) == nil
		switch {
		case valid && (r.Action != consumer.ActionAck || claimed.ID != id || claimed.Fingerprint != dedup.FingerprintOf([]byte(id))):
			t.Fatalf("valid id %q: result %+v, claimed %+v", id, r, claimed)
		case !valid && (r.Reason != consumer.OutcomeInvalidKey || claimed.ID != ""):
			t.Fatalf("invalid id %q: result %+v, claimed %+v", id, r, claimed)
		}
	})
}

// stubLeaseStore grants every claim.
type stubLeaseStore struct{ claim func(dedup.Key) }

func (s stubLeaseStore) Claim(_ context.Context, k dedup.Key) (*dedup.Lease, error) {
	s.claim(k)
	return &dedup.Lease{Key: k, Token: "t"}, nil
}
func (stubLeaseStore) Extend(context.Context, *dedup.Lease) error           { return nil }
func (stubLeaseStore) Complete(context.Context, *dedup.Lease, []byte) error { return nil }
func (stubLeaseStore) Release(context.Context, *dedup.Lease) error          { return nil }
