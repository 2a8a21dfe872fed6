package deduptest

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem/dedup"
)

func shortConfig(h LeaseHarness, inst func(Config) LeaseInstance) (LeaseInstance, Config) {
	cfg := Config{Lease: 2 * h.RealClockUnit, TTL: 2 * h.RealClockUnit}
	return inst(cfg), cfg
}

// testLeaseExpiry: when a lease runs out, a second owner gets in and the
// first owner's Extend, Complete and Release all fail with ErrLeaseLost
// without touching the new owner's claim.
func testLeaseExpiry(t *testing.T, h LeaseHarness) {
	inst, cfg := shortConfig(h, func(c Config) LeaseInstance { return h.New(t, c) })
	ctx := testCtx(t)
	onRealClock(t, inst, func(key dedup.Key) string {
		first, err := inst.Store.Claim(ctx, key)
		if err != nil {
			t.Fatalf("first claim: %v", err)
		}
		if first.TTL != cfg.Lease {
			t.Fatalf("lease TTL = %v, want the configured %v", first.TTL, cfg.Lease)
		}
		advance(inst, cfg.Lease+h.RealClockUnit)

		secondAt := time.Now()
		second, err := inst.Store.Claim(ctx, key)
		if err != nil {
			t.Fatalf("claim after lease expiry = %v, want a lease", err)
		}
		if err := inst.Store.Extend(ctx, first); !errors.Is(err, dedup.ErrLeaseLost) {
			t.Fatalf("stale Extend = %v, want ErrLeaseLost", err)
		}
		if err := inst.Store.Complete(ctx, first, []byte("stale")); !errors.Is(err, dedup.ErrLeaseLost) {
			t.Fatalf("stale Complete = %v, want ErrLeaseLost", err)
		}
		if err := inst.Store.Release(ctx, first); !errors.Is(err, dedup.ErrLeaseLost) {
			t.Fatalf("stale Release = %v, want ErrLeaseLost", err)
		}
		// The new owner is untouched.
		if _, err := inst.Store.Claim(ctx, key); !errors.Is(err, dedup.ErrInFlight) {
			if late := lateBy(inst, secondAt, cfg.Lease); late != "" {
				return "the second owner's lease: " + late
			}
			t.Fatalf("claim while the second owner holds = %v, want ErrInFlight", err)
		}
		if err := inst.Store.Complete(ctx, second, []byte("fresh")); err != nil {
			if late := lateBy(inst, secondAt, cfg.Lease); late != "" {
				return "the second owner's lease: " + late
			}
			t.Fatalf("second owner's Complete: %v", err)
		}
		_, err = inst.Store.Claim(ctx, key)
		if res, ok := dedup.StoredResult(err); !ok || string(res) != "fresh" {
			t.Fatalf("claim after complete = %v (result %q), want ErrDuplicate with %q", err, res, "fresh")
		}
		return ""
	})
}

// testLeaseExtend: an extended lease outlives its first term.
func testLeaseExtend(t *testing.T, h LeaseHarness) {
	inst, cfg := shortConfig(h, func(c Config) LeaseInstance { return h.New(t, c) })
	ctx := testCtx(t)
	onRealClock(t, inst, func(key dedup.Key) string {
		began := time.Now()
		l, err := inst.Store.Claim(ctx, key)
		if err != nil {
			t.Fatalf("claim: %v", err)
		}
		// Three extensions, each half a lease after the previous call
		// began: 1.5 leases pass in all, yet the last extension left a
		// full lease from its own time. On a real clock the step counts
		// from the start of the previous call, so that call's own latency
		// (a commit's fsync on a loaded machine) does not eat the half
		// lease of margin.
		step := cfg.Lease / 2
		for i := range 3 {
			if inst.Advance != nil {
				inst.Advance(step)
			} else {
				time.Sleep(time.Until(began.Add(step)))
			}
			prev := began
			began = time.Now()
			if err := inst.Store.Extend(ctx, l); err != nil {
				if late := lateBy(inst, prev, cfg.Lease); late != "" {
					return fmt.Sprintf("Extend #%d: %s", i+1, late)
				}
				t.Fatalf("Extend #%d: %v", i+1, err)
			}
		}
		if _, err := inst.Store.Claim(ctx, key); !errors.Is(err, dedup.ErrInFlight) {
			if late := lateBy(inst, began, cfg.Lease); late != "" {
				return "the extended lease: " + late
			}
			t.Fatalf("claim after %v on an extended lease of %v = %v, want ErrInFlight", 3*step, cfg.Lease, err)
		}
		if err := inst.Store.Complete(ctx, l, nil); err != nil {
			if late := lateBy(inst, began, cfg.Lease); late != "" {
				return "the extended lease: " + late
			}
			t.Fatalf("Complete after extensions: %v", err)
		}
		return ""
	})
}

// testLeaseTTL: a completed key is forgotten after its TTL.
func testLeaseTTL(t *testing.T, h LeaseHarness) {
	inst, cfg := shortConfig(h, func(c Config) LeaseInstance { return h.New(t, c) })
	ctx := testCtx(t)
	onRealClock(t, inst, func(key dedup.Key) string {
		l, err := inst.Store.Claim(ctx, key)
		if err != nil {
			t.Fatalf("claim: %v", err)
		}
		doneAt := time.Now()
		if err := inst.Store.Complete(ctx, l, nil); err != nil {
			t.Fatalf("Complete: %v", err)
		}
		if _, err := inst.Store.Claim(ctx, key); !errors.Is(err, dedup.ErrDuplicate) {
			if late := lateBy(inst, doneAt, cfg.TTL); late != "" {
				return "the completed key's TTL: " + late
			}
			t.Fatalf("claim within TTL = %v, want ErrDuplicate", err)
		}
		advance(inst, cfg.TTL+h.RealClockUnit)
		l2, err := inst.Store.Claim(ctx, key)
		if err != nil {
			t.Fatalf("claim after TTL = %v, want a lease", err)
		}
		if err := inst.Store.Release(ctx, l2); err != nil {
			t.Fatalf("Release: %v", err)
		}
		return ""
	})
}

// realClockTries bounds the runs of a real-clock scenario that came out
// inconclusive.
const realClockTries = 5

// onRealClock runs scenario, whose checks depend on how much time passes
// between calls, with a fresh key. On a real clock a check can fail only
// because the machine took longer than a lease between two calls; that
// proves nothing about the store, so scenario returns what was late instead
// of failing, and the scenario runs again with a new key, up to
// realClockTries times. A check that fails within its time bound fails the
// test, and so do realClockTries inconclusive runs in a row.
func onRealClock(t *testing.T, inst LeaseInstance, scenario func(key dedup.Key) string) {
	t.Helper()
	for try := 1; ; try++ {
		late := scenario(dedup.NewKey(uniqueID("scope"), uniqueID("pay"), []byte("p")))
		if late == "" {
			return
		}
		if try == realClockTries {
			t.Fatalf("%d runs in a row took longer than the lease they check (the last: %s); raise LeaseHarness.RealClockUnit for this store", try, late)
		}
		t.Logf("run %d inconclusive, again with a new key: %s", try, late)
	}
}

// lateBy says, on a real clock, that at least bound has passed since start:
// a lease or TTL of bound started then may have run out. It returns "" with
// a fake clock (the test moves time itself) or when less has passed.
func lateBy(inst LeaseInstance, start time.Time, bound time.Duration) string {
	if inst.Advance != nil {
		return ""
	}
	if el := time.Since(start); el >= bound {
		return fmt.Sprintf("%v passed since it began, not less than its %v", el.Round(time.Millisecond), bound)
	}
	return ""
}
