package memstore_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"strings"
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

// TestTokenMustMatchExactly: a lease owns its key only with the very token it
// was handed; the same number written another way, another store's token or
// a token with anything added is not the owner.
func TestTokenMustMatchExactly(t *testing.T) {
	s, err := memstore.New(memstore.Options{SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	other, err := memstore.New(memstore.Options{SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	ctx := testenv.Ctx(t)
	k := dedup.Key{Scope: "s", ID: "1"}
	// Lease numbers 1 to 10 of both stores, so that a token with a hex
	// letter exists.
	var l *dedup.Lease
	for i := range 11 {
		k.ID = strconv.Itoa(i)
		if l, err = s.Claim(ctx, k); err != nil {
			t.Fatal(err)
		}
		if _, err := other.Claim(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
	foreign, err := other.Claim(ctx, dedup.Key{Scope: "s", ID: "foreign"})
	if err != nil {
		t.Fatal(err)
	}
	cut := strings.LastIndexByte(l.Token, '-') + 1
	prefix, seq := l.Token[:cut], l.Token[cut:]
	if seq != "b" {
		t.Fatalf("the 11th token is %q, want the lease number b in hex after the prefix", l.Token)
	}
	for _, token := range []string{
		"",
		prefix,
		prefix + "B",
		prefix + "0b",
		prefix + "b0",
		prefix + " b",
		prefix + "+b",
		l.Token + "\x00",
		strings.ToUpper(prefix) + seq,
		other.Token(11),
		foreign.Token,
	} {
		forged := *l
		forged.Token = token
		if err := s.Complete(ctx, &forged, nil); !errors.Is(err, dedup.ErrLeaseLost) {
			t.Errorf("Complete with token %q (the lease's is %q): %v, want ErrLeaseLost", token, l.Token, err)
		}
	}
	if err := s.Complete(ctx, l, nil); err != nil {
		t.Fatalf("Complete with the lease's own token: %v", err)
	}
}

// TestExpiredResultIsForgotten: once a completed key's retention ran out, its
// result goes with it: the key is claimed afresh, and a later duplicate gets
// the new owner's result (or none), never the old one.
func TestExpiredResultIsForgotten(t *testing.T) {
	for _, sweep := range []bool{false, true} {
		clock := clocktest.NewManual(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
		s, err := memstore.New(memstore.Options{TTL: time.Minute, Clock: clock, SweepInterval: -1})
		if err != nil {
			t.Fatal(err)
		}
		ctx := testenv.Ctx(t)
		k := dedup.Key{Scope: "s", ID: "1"}
		l, err := s.Claim(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Complete(ctx, l, []byte("old")); err != nil {
			t.Fatal(err)
		}
		clock.Advance(time.Minute)
		if sweep {
			s.Sweep()
			if s.Len() != 0 {
				t.Fatalf("Len = %d after sweeping an expired key, want 0", s.Len())
			}
		}
		if l, err = s.Claim(ctx, k); err != nil {
			t.Fatalf("sweep %v: claim after the TTL: %v", sweep, err)
		}
		if err := s.Complete(ctx, l, nil); err != nil {
			t.Fatal(err)
		}
		_, err = s.Claim(ctx, k)
		if res, dup := dedup.StoredResult(err); !dup || res != nil {
			t.Fatalf("sweep %v: duplicate of the key completed again without a result: %v, result %q; want ErrDuplicate, no result", sweep, err, res)
		}
		_ = s.Close()
	}
}

// TestKeysApart: keys that differ only in where scope ends and id begins are
// different keys.
func TestKeysApart(t *testing.T) {
	s, err := memstore.New(memstore.Options{SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := testenv.Ctx(t)
	for _, k := range []dedup.Key{{Scope: "ab", ID: "c"}, {Scope: "a", ID: "bc"}, {Scope: "abc", ID: "c"}, {Scope: "a", ID: "bcc"}} {
		l, err := s.Claim(ctx, k)
		if err != nil {
			t.Fatalf("claim %q/%q: %v", k.Scope, k.ID, err)
		}
		if err := s.Complete(ctx, l, nil); err != nil {
			t.Fatal(err)
		}
	}
}

// TestHeapPerMark bounds the heap a completed key costs: a 16-byte digest of
// scope and id and a 48-byte mark (expiry, lease number, fingerprint), a
// 64-byte slot of the store's map, with nothing else on the heap (the key's
// strings are not kept). The map keeps 7/8 of its slots full at most and, as
// it grows by doubling, 7/16 at least: at worst 64·16/7 ≈ 146 bytes a mark,
// plus a control byte per slot. The bound, 160 bytes, holds at any number
// of marks.
func TestHeapPerMark(t *testing.T) {
	const n = 50_000
	const bound = 160 // bytes per mark
	s, err := memstore.New(memstore.Options{SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := testenv.Ctx(t)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := range n {
		k := dedup.Key{
			Scope:       "billing/charge",
			ID:          fmt.Sprintf("%08x-0000-4000-8000-%012x", i, i),
			Fingerprint: dedup.FingerprintOf([]byte(strconv.Itoa(i))),
		}
		l, err := s.Claim(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Complete(ctx, l, nil); err != nil {
			t.Fatal(err)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if s.Len() != n {
		t.Fatalf("Len = %d, want %d", s.Len(), n)
	}
	perMark := (float64(after.HeapAlloc) - float64(before.HeapAlloc)) / n
	t.Logf("%.1f bytes of heap per completed key", perMark)
	if perMark > bound {
		t.Errorf("%d completed keys take %.1f bytes of heap each, want at most %d", n, perMark, bound)
	}
}
