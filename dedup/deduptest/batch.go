package deduptest

import (
	"errors"
	"testing"

	"github.com/idemkit/idem/dedup"
)

// testLeaseBatch: a batch claim grants exactly what single claims would, in
// order, including a key repeated inside the batch.
func testLeaseBatch(t *testing.T, h LeaseHarness) {
	inst := h.New(t, longConfig())
	bs, ok := inst.Store.(dedup.BatchLeaseStore)
	if !ok {
		t.Skip("store has no batch claim")
	}
	ctx := testCtx(t)
	scope := uniqueID("scope")
	k1 := dedup.NewKey(scope, uniqueID("a"), []byte("1"))
	k2 := dedup.NewKey(scope, uniqueID("b"), []byte("2"))
	k3 := dedup.NewKey(scope, uniqueID("c"), []byte("3"))
	bad := dedup.Key{Scope: scope, ID: "bad\x00"}

	res, err := bs.ClaimBatch(ctx, []dedup.Key{k1, k2, k1, bad})
	if err != nil {
		t.Fatalf("ClaimBatch: %v", err)
	}
	if len(res) != 4 {
		t.Fatalf("ClaimBatch returned %d results for 4 keys", len(res))
	}
	if res[0].Err != nil || res[0].Lease == nil || res[1].Err != nil || res[1].Lease == nil {
		t.Fatalf("new keys: %+v %+v, want leases", res[0], res[1])
	}
	if !errors.Is(res[2].Err, dedup.ErrInFlight) || res[2].Lease != nil {
		t.Fatalf("repeated key in one batch: %+v, want ErrInFlight", res[2])
	}
	if !errors.Is(res[3].Err, dedup.ErrInvalidKey) || res[3].Lease != nil {
		t.Fatalf("invalid key in batch: %+v, want ErrInvalidKey", res[3])
	}
	if err := bs.Complete(ctx, res[0].Lease, []byte("r1")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if err := bs.Release(ctx, res[1].Lease); err != nil {
		t.Fatalf("Release: %v", err)
	}
	other := dedup.NewKey(scope, k1.ID, []byte("other content"))
	res, err = bs.ClaimBatch(ctx, []dedup.Key{k1, k2, k3, other})
	if err != nil {
		t.Fatalf("second ClaimBatch: %v", err)
	}
	if r, ok := dedup.StoredResult(res[0].Err); !ok || string(r) != "r1" || res[0].Lease != nil {
		t.Fatalf("completed key in batch: %+v, want ErrDuplicate with r1", res[0])
	}
	if res[1].Err != nil || res[2].Err != nil {
		t.Fatalf("released and new keys: %v %v, want leases", res[1].Err, res[2].Err)
	}
	if !errors.Is(res[3].Err, dedup.ErrFingerprintMismatch) {
		t.Fatalf("other content in batch: %v, want ErrFingerprintMismatch", res[3].Err)
	}
	if _, err := bs.ClaimBatch(ctx, nil); err != nil {
		t.Fatalf("empty batch: %v", err)
	}
}
