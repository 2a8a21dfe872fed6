package leasekeep

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/telemetry"
)

// failingComplete is a lease store whose Complete fails.
type failingComplete struct{ dedup.LeaseStore }

func (failingComplete) Complete(context.Context, *dedup.Lease, []byte) error {
	return errors.New("store down")
}

// TestRunSettle: each way a handler's run ends leaves the key as the lease
// flow promises — completed with its result, released for the redelivery,
// untouched when the lease was lost, or still in flight when Complete
// failed — and Settle answers the matching outcome and error.
func TestRunSettle(t *testing.T) {
	herr := errors.New("handler failed")
	cases := []struct {
		name     string
		herr     error
		lose     bool // the lease runs out while the handler runs
		failing  bool // Complete fails
		abandon  bool // the handler panics
		outcome  string
		errIs    error
		keyAfter error // the verdict of a new claim of the key afterwards; nil: granted
	}{
		{name: "completed", outcome: telemetry.HandledCompleted, keyAfter: dedup.ErrDuplicate},
		{name: "handler failed", herr: herr, outcome: telemetry.HandledReleased, errIs: herr},
		{name: "lease lost", lose: true, outcome: telemetry.HandledLeaseLost, errIs: dedup.ErrLeaseLost, keyAfter: dedup.ErrInFlight},
		{name: "lease lost and handler failed", herr: herr, lose: true, outcome: telemetry.HandledLeaseLost, errIs: herr, keyAfter: dedup.ErrInFlight},
		{name: "complete failed", failing: true, outcome: telemetry.HandledCompleteFailed, keyAfter: dedup.ErrInFlight},
		{name: "panicked", abandon: true, outcome: telemetry.HandledReleased},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				const ttl = time.Second
				mem, err := memstore.New(memstore.Options{Lease: ttl, SweepInterval: -1})
				if err != nil {
					t.Fatal(err)
				}
				defer mem.Close()
				var store dedup.LeaseStore = mem
				if c.failing {
					store = failingComplete{mem}
				}
				ctx := context.Background()
				key := dedup.Key{Scope: "run", ID: "1"}
				lease, err := store.Claim(ctx, key)
				if err != nil {
					t.Fatal(err)
				}
				var r Run
				every := ttl / 3
				if c.lose {
					// Beats too rare: the lease runs out before the
					// first one, which finds it gone.
					every = 3 * ttl / 2
				}
				New(store, nil, "test").Begin(ctx, nil, &r, lease, every, time.Second)
				defer r.End()
				if c.lose {
					advance(8 * ttl / 5)
					if !errors.Is(context.Cause(&r.Ctx), dedup.ErrLeaseLost) {
						t.Fatalf("the handler's context was not cancelled with the lost lease: %v", context.Cause(&r.Ctx))
					}
					// Another owner holds the key now.
					if _, err := store.Claim(ctx, key); err != nil {
						t.Fatalf("claim after the lease ran out: %v", err)
					}
				} else {
					advance(3 * ttl) // beats keep the lease past its TTL
				}
				var (
					o    string
					serr error
				)
				if c.abandon {
					o = r.Abandon()
				} else {
					o, serr = r.Settle(c.herr, []byte("result"), nil)
				}
				if o != c.outcome {
					t.Errorf("outcome %q, want %q", o, c.outcome)
				}
				if c.errIs == nil && serr != nil && !c.failing {
					t.Errorf("error %v, want nil", serr)
				}
				if c.errIs != nil && !errors.Is(serr, c.errIs) {
					t.Errorf("error %v, want one wrapping %v", serr, c.errIs)
				}
				if c.failing && serr == nil {
					t.Error("a failed Complete returned no error")
				}
				_, err = mem.Claim(ctx, key)
				switch {
				case c.keyAfter == nil && err != nil:
					t.Errorf("the key was not released: a new claim got %v", err)
				case c.keyAfter != nil && !errors.Is(err, c.keyAfter):
					t.Errorf("a new claim got %v, want %v", err, c.keyAfter)
				}
				if c.outcome == telemetry.HandledCompleted {
					if got, _ := dedup.StoredResult(err); string(got) != "result" {
						t.Errorf("stored result %q, want %q", got, "result")
					}
				}
			})
		})
	}
}
