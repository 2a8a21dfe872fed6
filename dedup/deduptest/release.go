package deduptest

import (
	"errors"
	"testing"

	"github.com/idemkit/idem/dedup"
)

// testLeaseRelease: a failed handler releases the key and the redelivery
// claims it again; a release or complete with a foreign token is refused.
func testLeaseRelease(t *testing.T, h LeaseHarness) {
	inst := h.New(t, longConfig())
	ctx := testCtx(t)
	key := dedup.NewKey(uniqueID("scope"), uniqueID("pay"), []byte("p"))

	l1, err := inst.Store.Claim(ctx, key)
	if err != nil {
		t.Fatalf("first claim: %v", err)
	}
	forged := &dedup.Lease{Key: key, Token: "not-the-owner", TTL: l1.TTL}
	if err := inst.Store.Release(ctx, forged); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("Release with a foreign token = %v, want ErrLeaseLost", err)
	}
	if err := inst.Store.Complete(ctx, forged, nil); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("Complete with a foreign token = %v, want ErrLeaseLost", err)
	}
	if err := inst.Store.Extend(ctx, forged); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("Extend with a foreign token = %v, want ErrLeaseLost", err)
	}
	// The forged calls changed nothing: the key is still in flight.
	if _, err := inst.Store.Claim(ctx, key); !errors.Is(err, dedup.ErrInFlight) {
		t.Fatalf("claim while held = %v, want ErrInFlight", err)
	}

	// Handler failed: release.
	if err := inst.Store.Release(ctx, l1); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if err := inst.Store.Complete(ctx, l1, nil); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("Complete after own Release = %v, want ErrLeaseLost", err)
	}
	// Redelivery runs again.
	l2, err := inst.Store.Claim(ctx, key)
	if err != nil {
		t.Fatalf("claim after release = %v, want a lease", err)
	}
	if l2.Token == l1.Token {
		t.Fatal("second owner got the same token as the first")
	}
	if err := inst.Store.Complete(ctx, l2, nil); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if _, err := inst.Store.Claim(ctx, key); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("claim after complete = %v, want ErrDuplicate", err)
	}
	if err := inst.Store.Release(ctx, l2); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("Release after Complete = %v, want ErrLeaseLost (a done key is never released)", err)
	}
	if _, err := inst.Store.Claim(ctx, key); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("claim after refused release = %v, want ErrDuplicate", err)
	}
}

// testLeaseScopes: two scopes with the same id each run once.
func testLeaseScopes(t *testing.T, h LeaseHarness) {
	inst := h.New(t, longConfig())
	ctx := testCtx(t)
	id := uniqueID("evt")
	for _, scope := range []string{uniqueID("billing"), uniqueID("email")} {
		key := dedup.NewKey(scope, id, []byte("same event"))
		l, err := inst.Store.Claim(ctx, key)
		if err != nil {
			t.Fatalf("scope %s: claim = %v, want a lease", scope, err)
		}
		if err := inst.Store.Complete(ctx, l, nil); err != nil {
			t.Fatalf("scope %s: Complete: %v", scope, err)
		}
		if _, err := inst.Store.Claim(ctx, key); !errors.Is(err, dedup.ErrDuplicate) {
			t.Fatalf("scope %s: second claim = %v, want ErrDuplicate", scope, err)
		}
	}
}
