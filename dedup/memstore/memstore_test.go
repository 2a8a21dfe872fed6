package memstore_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/dedup/memstore"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestConformance(t *testing.T) {
	deduptest.RunLease(t, deduptest.LeaseHarness{
		New: func(t testing.TB, cfg deduptest.Config) deduptest.LeaseInstance {
			clock := dedup.NewManualClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
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

func TestSweeperRemovesExpired(t *testing.T) {
	clock := dedup.NewManualClock(time.Unix(0, 0))
	s, err := memstore.New(memstore.Options{Clock: clock, TTL: time.Minute, SweepInterval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := deduptest.Ctx(t)
	l, err := s.Claim(ctx, dedup.Key{Scope: "s", ID: "1"})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(ctx, l, nil); err != nil {
		t.Fatal(err)
	}
	if s.Len() != 1 {
		t.Fatalf("Len = %d, want 1", s.Len())
	}
	clock.Advance(2 * time.Minute)
	deadline := time.Now().Add(10 * time.Second)
	for s.Len() != 0 && time.Now().Before(deadline) {
		time.Sleep(2 * time.Millisecond)
	}
	if s.Len() != 0 {
		t.Fatal("expired entry still counted")
	}
}

// TestSystemClockExpiry: with the system clock the store reads only the
// monotonic clock; leases still run out after Options.Lease, not before.
func TestSystemClockExpiry(t *testing.T) {
	const lease = 50 * time.Millisecond
	s, err := memstore.New(memstore.Options{Lease: lease, SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := deduptest.Ctx(t)
	k := dedup.Key{Scope: "s", ID: "1"}
	start := time.Now()
	first, err := s.Claim(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	for {
		_, err := s.Claim(ctx, k)
		if err == nil {
			break
		}
		if !errors.Is(err, dedup.ErrInFlight) {
			t.Fatalf("claim while the lease runs: %v", err)
		}
		if time.Since(start) > 10*time.Second {
			t.Fatal("the lease never ran out")
		}
		time.Sleep(lease / 10)
	}
	if took := time.Since(start); took < lease {
		t.Fatalf("the lease ran out after %v, before its %v", took, lease)
	}
	if err := s.Complete(ctx, first, nil); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("Complete of the expired lease: %v, want ErrLeaseLost", err)
	}
}

// TestLeaseBlocks: leases and tokens come from per-shard blocks; across many
// blocks every lease is its own (a later claim never changes an earlier
// lease), every token is different, and a lease with another lease's token
// does not own the key.
func TestLeaseBlocks(t *testing.T) {
	s, err := memstore.New(memstore.Options{SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := deduptest.Ctx(t)
	const n = 5000 // many blocks of every shard
	leases := make([]*dedup.Lease, n)
	tokens := make(map[string]bool, n)
	for i := range leases {
		k := dedup.Key{Scope: "s", ID: strconv.Itoa(i)}
		l, err := s.Claim(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		if tokens[l.Token] {
			t.Fatalf("token %q handed out twice", l.Token)
		}
		tokens[l.Token] = true
		leases[i] = l
	}
	for i, l := range leases {
		if l.Key.ID != strconv.Itoa(i) || l.TTL != 30*time.Second {
			t.Fatalf("lease %d changed: %+v", i, l)
		}
	}
	uppers := 0
	for i := 0; i+1 < n; i += 2 {
		a, b := *leases[i], *leases[i+1]
		a.Token, b.Token = b.Token, a.Token
		if err := s.Complete(ctx, &a, nil); !errors.Is(err, dedup.ErrLeaseLost) {
			t.Fatalf("lease %d with lease %d's token: %v, want ErrLeaseLost", i, i+1, err)
		}
		// The token number's hex digits in upper case are not the token
		// handed out.
		upper := *leases[i]
		cut := len(upper.Token) - 16
		upper.Token = upper.Token[:cut] + strings.ToUpper(upper.Token[cut:])
		if upper.Token != leases[i].Token {
			uppers++
			if err := s.Extend(ctx, &upper); !errors.Is(err, dedup.ErrLeaseLost) {
				t.Fatalf("lease %d with its token in upper case %q: %v, want ErrLeaseLost", i, upper.Token, err)
			}
		}
		if err := s.Complete(ctx, leases[i], nil); err != nil {
			t.Fatalf("lease %d: %v", i, err)
		}
		if err := s.Release(ctx, leases[i+1]); err != nil {
			t.Fatalf("lease %d: %v", i+1, err)
		}
	}
	if uppers == 0 {
		t.Fatal("no token had a letter among its digits to upper-case")
	}
}

// TestClaimAllocations: a claim takes its lease and token from the shard's
// block, so most claims allocate nothing (a Release keeps the table's size).
func TestClaimAllocations(t *testing.T) {
	s, err := memstore.New(memstore.Options{SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	keys := make([]dedup.Key, 20000)
	for i := range keys {
		keys[i] = dedup.Key{Scope: "s", ID: strconv.Itoa(i)}
	}
	i := 0
	claimRelease := func() {
		l, err := s.Claim(ctx, keys[i])
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Release(ctx, l); err != nil {
			t.Fatal(err)
		}
		i++
	}
	for range 1000 { // every shard's table allocated
		claimRelease()
	}
	if n := testing.AllocsPerRun(10000, claimRelease); n >= 0.5 {
		t.Fatalf("%v allocations per claim, want (almost) none", n)
	}
}
