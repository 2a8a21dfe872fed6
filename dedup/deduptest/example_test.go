package deduptest_test

import (
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/dedup/memstore"
)

// A lease store runs the suite from its own test with a harness that makes a
// fresh, isolated instance per subtest. This one wires dedup/memstore with a
// clock that moves only when told to, so the expiry tests move time instead of sleeping, and a
// closed store as the "backend down" case. The test itself is one line:
//
//	func TestConformance(t *testing.T) { deduptest.RunLease(t, harness) }
func ExampleRunLease() {
	harness := deduptest.LeaseHarness{
		New: func(t testing.TB, cfg deduptest.Config) deduptest.LeaseInstance {
			clock := &manualClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
			s, err := memstore.New(memstore.Options{Lease: cfg.Lease, TTL: cfg.TTL, Clock: clock})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = s.Close() })
			return deduptest.LeaseInstance{Store: s, Advance: clock.Advance}
		},
		Down: func(t testing.TB) dedup.LeaseStore {
			s, err := memstore.New(memstore.Options{})
			if err != nil {
				t.Fatal(err)
			}
			_ = s.Close() // every call now fails with dedup.ErrClosed
			return s
		},
	}
	// In the store's _test.go file this is the body of TestConformance.
	_ = func(t *testing.T) { deduptest.RunLease(t, harness) }
}

// manualClock is a dedup.Clock that moves only when told to.
type manualClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *manualClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *manualClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}
