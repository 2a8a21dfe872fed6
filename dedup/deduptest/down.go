package deduptest

import (
	"errors"
	"testing"
	"time"

	"github.com/idemkit/idem/dedup"
)

// testLeaseDown: a store whose backend is unreachable returns an error,
// never a lease and never "duplicate" (which would ACK and drop the message).
func testLeaseDown(t *testing.T, h LeaseHarness) {
	if h.Down == nil {
		t.Fatal("LeaseHarness.Down is nil: every store must show that it fails closed")
	}
	s := h.Down(t)
	ctx := testCtx(t)
	key := dedup.NewKey(uniqueID("scope"), uniqueID("pay"), []byte("p"))
	start := time.Now()
	l, err := s.Claim(ctx, key)
	if err == nil || l != nil {
		t.Fatalf("Claim on a down store = (%v, %v), want an error and no lease", l, err)
	}
	for _, sentinel := range []error{dedup.ErrDuplicate, dedup.ErrInFlight, dedup.ErrInvalidKey} {
		if errors.Is(err, sentinel) {
			t.Fatalf("Claim on a down store = %v; it must not look like %v", err, sentinel)
		}
	}
	t.Logf("down store answered in %v with: %v", time.Since(start).Round(time.Millisecond), err)
	if bs, ok := s.(dedup.BatchLeaseStore); ok {
		res, err := bs.ClaimBatch(ctx, []dedup.Key{key})
		if err == nil {
			for _, r := range res {
				if r.Err == nil || r.Lease != nil {
					t.Fatalf("ClaimBatch on a down store granted a lease")
				}
			}
		}
	}
}
