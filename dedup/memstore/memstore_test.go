package memstore_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/testkit/clocktest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestConformance(t *testing.T) {
	deduptest.RunLease(t, deduptest.LeaseHarness{
		New: func(t testing.TB, cfg deduptest.Config) deduptest.LeaseInstance {
			clock := clocktest.NewManual(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
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
			_ = s.Close()
			return s
		},
	})
}

func TestOptionsErrors(t *testing.T) {
	for name, o := range map[string]memstore.Options{
		"negative lease": {Lease: -time.Second},
		"negative TTL":   {TTL: -time.Second},
	} {
		if _, err := memstore.New(o); err == nil {
			t.Errorf("%s: New succeeded", name)
		}
	}
}

// advance moves a synctest bubble's clock on by d and waits until every
// goroutine of the bubble is blocked again (a sweep that came due ran).
func advance(d time.Duration) {
	time.Sleep(d)
	synctest.Wait()
}

// TestSweeperRemovesExpired: the sweeper removes a completed key once its
// TTL has passed, on the system clock (in a synctest bubble, whose clock
// moves when every goroutine in it is blocked).
func TestSweeperRemovesExpired(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s, err := memstore.New(memstore.Options{TTL: time.Minute, SweepInterval: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		ctx := context.Background()
		l, err := s.Claim(ctx, dedup.Key{Scope: "s", ID: "1"})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Complete(ctx, l, nil); err != nil {
			t.Fatal(err)
		}
		advance(59 * time.Second)
		if s.Len() != 1 {
			t.Fatalf("Len = %d before the TTL ran out, want 1", s.Len())
		}
		advance(2 * time.Second)
		if s.Len() != 0 {
			t.Fatalf("Len = %d a sweep after the TTL ran out, want 0", s.Len())
		}
	})
}

// TestSystemClockExpiry: with the system clock a lease runs out after
// Options.Lease, not before, and its owner can no longer complete it.
func TestSystemClockExpiry(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const lease = 50 * time.Millisecond
		s, err := memstore.New(memstore.Options{Lease: lease, SweepInterval: -1})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		ctx := context.Background()
		k := dedup.Key{Scope: "s", ID: "1"}
		first, err := s.Claim(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		advance(lease - time.Nanosecond)
		if _, err := s.Claim(ctx, k); !errors.Is(err, dedup.ErrInFlight) {
			t.Fatalf("claim just before the lease runs out: %v, want ErrInFlight", err)
		}
		advance(time.Nanosecond)
		if _, err := s.Claim(ctx, k); err != nil {
			t.Fatalf("claim once the lease ran out: %v", err)
		}
		if err := s.Complete(ctx, first, nil); !errors.Is(err, dedup.ErrLeaseLost) {
			t.Fatalf("Complete of the expired lease: %v, want ErrLeaseLost", err)
		}
	})
}

// TestTokens: every lease gets a token of its own, and a lease holding
// another lease's token does not own the key.
func TestTokens(t *testing.T) {
	s, err := memstore.New(memstore.Options{SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := testenv.Ctx(t)
	const n = 1000
	leases := make([]*dedup.Lease, n)
	tokens := make(map[string]bool, n)
	for i := range leases {
		l, err := s.Claim(ctx, dedup.Key{Scope: "s", ID: strconv.Itoa(i)})
		if err != nil {
			t.Fatal(err)
		}
		if tokens[l.Token] {
			t.Fatalf("token %q handed out twice", l.Token)
		}
		tokens[l.Token] = true
		leases[i] = l
	}
	for i := 0; i+1 < n; i += 2 {
		a, b := *leases[i], *leases[i+1]
		a.Token, b.Token = b.Token, a.Token
		if err := s.Complete(ctx, &a, nil); !errors.Is(err, dedup.ErrLeaseLost) {
			t.Fatalf("lease %d with lease %d's token: %v, want ErrLeaseLost", i, i+1, err)
		}
		if err := s.Extend(ctx, &b); !errors.Is(err, dedup.ErrLeaseLost) {
			t.Fatalf("lease %d with lease %d's token: %v, want ErrLeaseLost", i+1, i, err)
		}
		if err := s.Complete(ctx, leases[i], nil); err != nil {
			t.Fatalf("lease %d: %v", i, err)
		}
		if err := s.Release(ctx, leases[i+1]); err != nil {
			t.Fatalf("lease %d: %v", i+1, err)
		}
	}
	if s.Len() != n/2 {
		t.Fatalf("Len = %d, want %d completed keys", s.Len(), n/2)
	}
}
