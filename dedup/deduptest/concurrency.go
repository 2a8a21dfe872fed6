package deduptest

import (
	"errors"
	"sync"
	"testing"

	"github.com/idemkit/idem/dedup"
)

// testLeaseConcurrency: N goroutines claim one key; exactly one gets the
// lease, the others see it in flight; after Complete all see a duplicate with
// the stored result.
func testLeaseConcurrency(t *testing.T, h LeaseHarness) {
	inst := h.New(t, longConfig())
	ctx := testCtx(t)
	key := dedup.NewKey(uniqueID("scope"), uniqueID("pay"), []byte(`{"amount":100}`))

	var (
		mu       sync.Mutex
		leases   []*dedup.Lease
		inFlight int
		other    []error
		start    = make(chan struct{})
		wg       sync.WaitGroup
	)
	for range h.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			l, err := inst.Store.Claim(ctx, key)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				leases = append(leases, l)
			case errors.Is(err, dedup.ErrInFlight):
				inFlight++
			default:
				other = append(other, err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if len(other) > 0 {
		t.Fatalf("unexpected claim errors: %v", other)
	}
	if len(leases) != 1 {
		t.Fatalf("%d goroutines got the lease, want exactly 1", len(leases))
	}
	if inFlight != h.Concurrency-1 {
		t.Fatalf("%d saw ErrInFlight, want %d", inFlight, h.Concurrency-1)
	}
	if leases[0].Token == "" {
		t.Fatal("lease has an empty token")
	}
	if err := inst.Store.Complete(ctx, leases[0], []byte("charged-once")); err != nil {
		t.Fatalf("Complete: %v", err)
	}

	var dups, wrong int
	var errs []error
	for range h.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := inst.Store.Claim(ctx, key)
			res, isDup := dedup.StoredResult(err)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case isDup && string(res) == "charged-once":
				dups++
			case isDup:
				wrong++
			default:
				errs = append(errs, err)
			}
		}()
	}
	wg.Wait()
	if len(errs) > 0 || wrong > 0 {
		t.Fatalf("after Complete: %d wrong results, errors %v", wrong, errs)
	}
	if dups != h.Concurrency {
		t.Fatalf("%d duplicates, want %d", dups, h.Concurrency)
	}
}
