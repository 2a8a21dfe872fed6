// Package deduptest is the conformance suite every idem store runs. A store's
// own test calls RunLease (lease stores) or RunTx (transactional stores) with
// a harness that makes fresh, isolated instances; the suite then checks the
// semantics every store promises: one owner among many concurrent claims, release
// on failure, scopes, lease and retention expiry, fingerprints, key
// validation, and failing closed when the backend is down.
//
// Each area lives in its own file: concurrency.go, release.go, expiry.go,
// fingerprint.go, keys.go, down.go, batch.go and tx.go.
package deduptest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"testing"
	"time"

	"github.com/idemkit/idem/dedup"
)

// Config is what the suite asks of a new store instance.
type Config struct {
	// Lease is the lease duration the store must grant.
	Lease time.Duration
	// TTL is how long the store must remember a completed key.
	TTL time.Duration
}

// LeaseInstance is one store made for one subtest.
type LeaseInstance struct {
	Store dedup.LeaseStore
	// Advance moves the store's clock forward by d. Nil means the store
	// runs on a real clock (its server's) and the suite sleeps instead.
	Advance func(d time.Duration)
}

// LeaseHarness tells RunLease how to make stores.
type LeaseHarness struct {
	// New returns a store isolated from every other instance (its own key
	// prefix or table), configured with cfg. Register cleanup with t.
	New func(t testing.TB, cfg Config) LeaseInstance
	// Down returns a store whose backend is unreachable (a closed port, a
	// closed pool). Nil skips nothing: the suite fails, since every store
	// must show that it fails closed.
	Down func(t testing.TB) dedup.LeaseStore
	// Concurrency is the number of goroutines that race for one key.
	// Defaults to 100.
	Concurrency int
	// RealClockUnit is the lease unit used with real clocks: leases and
	// TTLs in expiry tests are small multiples of it. Defaults to 500ms.
	RealClockUnit time.Duration
}

// testCtx returns a context that ends with the test, with a generous deadline so
// a hung store fails the test instead of hanging CI.
func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// uniqueID returns a random id, so runs against a shared server never see
// each other's keys.
func uniqueID(prefix string) string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return prefix + "-" + hex.EncodeToString(b[:])
}

// RunLease runs the lease conformance suite.
func RunLease(t *testing.T, h LeaseHarness) {
	if h.New == nil {
		t.Fatal("deduptest: LeaseHarness.New is nil")
	}
	if h.Concurrency <= 0 {
		h.Concurrency = 100
	}
	if h.RealClockUnit <= 0 {
		h.RealClockUnit = 500 * time.Millisecond
	}
	t.Run("Concurrency", func(t *testing.T) { testLeaseConcurrency(t, h) })
	t.Run("ReleaseOnFailure", func(t *testing.T) { testLeaseRelease(t, h) })
	t.Run("Scopes", func(t *testing.T) { testLeaseScopes(t, h) })
	t.Run("LeaseExpiry", func(t *testing.T) { testLeaseExpiry(t, h) })
	t.Run("Extend", func(t *testing.T) { testLeaseExtend(t, h) })
	t.Run("TTLExpiry", func(t *testing.T) { testLeaseTTL(t, h) })
	t.Run("Fingerprint", func(t *testing.T) { testLeaseFingerprint(t, h) })
	t.Run("InvalidKeys", func(t *testing.T) { testLeaseInvalidKeys(t, h) })
	t.Run("StoreDown", func(t *testing.T) { testLeaseDown(t, h) })
	t.Run("Batch", func(t *testing.T) { testLeaseBatch(t, h) })
}

// longConfig is for tests in which no lease may run out.
func longConfig() Config { return Config{Lease: time.Minute, TTL: time.Hour} }

// advance moves inst's clock by d, or sleeps d when it has a real clock.
func advance(inst LeaseInstance, d time.Duration) {
	if inst.Advance != nil {
		inst.Advance(d)
		return
	}
	time.Sleep(d)
}
