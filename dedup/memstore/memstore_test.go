package memstore_test

import (
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
