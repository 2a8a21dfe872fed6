package deduptest

import (
	"errors"
	"testing"

	"github.com/idemkit/idem/dedup"
)

// testLeaseFingerprint: the same key with other content is refused with
// ErrFingerprintMismatch; the same content, or no fingerprint, is a duplicate.
func testLeaseFingerprint(t *testing.T, h LeaseHarness) {
	inst := h.New(t, longConfig())
	ctx := testCtx(t)
	scope, id := uniqueID("scope"), uniqueID("pay")
	a := dedup.NewKey(scope, id, []byte(`{"amount":100}`))
	b := dedup.NewKey(scope, id, []byte(`{"amount":900}`))

	l, err := inst.Store.Claim(ctx, a)
	if err != nil {
		t.Fatalf("claim: %v", err)
	}
	// While in flight, other content must not get in; either answer is
	// safe.
	if _, err := inst.Store.Claim(ctx, b); !errors.Is(err, dedup.ErrFingerprintMismatch) && !errors.Is(err, dedup.ErrInFlight) {
		t.Fatalf("claim of other content while in flight = %v, want ErrFingerprintMismatch or ErrInFlight", err)
	}
	if err := inst.Store.Complete(ctx, l, nil); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	_, err = inst.Store.Claim(ctx, b)
	if !errors.Is(err, dedup.ErrFingerprintMismatch) {
		t.Fatalf("claim of other content = %v, want ErrFingerprintMismatch", err)
	}
	if errors.Is(err, dedup.ErrDuplicate) {
		t.Fatal("a mismatch must not also be a duplicate: it would be ACKed and dropped")
	}
	if _, err := inst.Store.Claim(ctx, a); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("claim of the same content = %v, want ErrDuplicate", err)
	}
	noFP := dedup.Key{Scope: scope, ID: id}
	if _, err := inst.Store.Claim(ctx, noFP); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("claim without a fingerprint = %v, want ErrDuplicate", err)
	}
}
