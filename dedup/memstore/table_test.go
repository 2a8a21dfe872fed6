package memstore

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/idemkit/idem/dedup"
)

// checkTable fails t unless tb's count matches its occupied slots, its load
// is within 3/4, and every key is reachable: no empty slot lies between a
// key's home index and its slot.
func checkTable(t *testing.T, tb *table) {
	t.Helper()
	if len(tb.slots) == 0 {
		if tb.n != 0 {
			t.Fatalf("empty table counts %d slots", tb.n)
		}
		return
	}
	if c := len(tb.slots); c&(c-1) != 0 {
		t.Fatalf("capacity %d is not a power of two", c)
	}
	if tb.n*4 > len(tb.slots)*3 {
		t.Fatalf("load %d/%d above 3/4", tb.n, len(tb.slots))
	}
	mask := len(tb.slots) - 1
	n := 0
	for i := range tb.slots {
		if tb.slots[i].empty() {
			continue
		}
		n++
		for j := tb.home(tb.slots[i].h0); j != i; j = (j + 1) & mask {
			if tb.slots[j].empty() {
				t.Fatalf("slot %d (home %d) is behind empty slot %d", i, tb.home(tb.slots[i].h0), j)
			}
		}
		if k, ok := tb.find(tb.slots[i].h0, tb.slots[i].h1); !ok || k != i {
			t.Fatalf("find of slot %d = %d, %v", i, k, ok)
		}
	}
	if n != tb.n {
		t.Fatalf("%d occupied slots, table counts %d", n, tb.n)
	}
}

// put inserts or overwrites a key the way claimLocked does.
func put(tb *table, h0, h1, v uint64, expires int64) {
	i, ok := tb.find(h0, h1)
	if !ok && (i < 0 || (tb.n+1)*4 > len(tb.slots)*3) {
		tb.reserve()
		i, _ = tb.find(h0, h1)
	}
	if !ok {
		tb.n++
	}
	tb.slots[i] = slot{h0: h0, h1: h1, meta: inFlightMeta(v), expires: expires}
}

func del(tb *table, h0, h1 uint64) bool {
	i, ok := tb.find(h0, h1)
	if ok {
		tb.remove(i)
	}
	return ok
}

// TestTableOneChain puts every key on one probe chain (home index 0), removes
// keys from the middle, the start and the end of it, and looks up the keys
// after each removed one.
func TestTableOneChain(t *testing.T) {
	for _, homeMask := range []uint64{0, 1, 3} {
		t.Run(fmt.Sprint("homeMask=", homeMask), func(t *testing.T) {
			tb := &table{homeMask: homeMask}
			const n = 1000
			for k := uint64(1); k <= n; k++ {
				put(tb, k*0x9e3779b97f4a7c15, k, k, 0)
			}
			checkTable(t, tb)
			present := map[uint64]bool{}
			for k := uint64(1); k <= n; k++ {
				present[k] = true
			}
			// Remove every third key, then the first and the last.
			var order []uint64
			for k := uint64(2); k <= n; k += 3 {
				order = append(order, k)
			}
			order = append(order, 1, n)
			for _, k := range order {
				if !del(tb, k*0x9e3779b97f4a7c15, k) {
					t.Fatalf("key %d not found for removal", k)
				}
				delete(present, k)
				// Every key after the hole must still be found.
				for j := k + 1; j <= n && j < k+20; j++ {
					i, ok := tb.find(j*0x9e3779b97f4a7c15, j)
					if ok != present[j] || (ok && tb.slots[i].seq() != j) {
						t.Fatalf("after removing %d: find(%d) = %v, want %v", k, j, ok, present[j])
					}
				}
			}
			checkTable(t, tb)
			for k := uint64(1); k <= n; k++ {
				if _, ok := tb.find(k*0x9e3779b97f4a7c15, k); ok != present[k] {
					t.Fatalf("find(%d) = %v, want %v", k, ok, present[k])
				}
			}
			if tb.n != len(present) {
				t.Fatalf("n = %d, want %d", tb.n, len(present))
			}
		})
	}
}

// TestTableSameH0 stores keys whose h0 is equal and whose h1 differs: the
// full 128 bits tell them apart.
func TestTableSameH0(t *testing.T) {
	tb := &table{homeMask: ^uint64(0)}
	for k := uint64(0); k < 100; k++ {
		put(tb, 42, k, k, 0)
	}
	del(tb, 42, 50)
	for k := uint64(0); k < 100; k++ {
		i, ok := tb.find(42, k)
		if ok != (k != 50) || (ok && tb.slots[i].seq() != k) {
			t.Fatalf("find(42, %d) = %v", k, ok)
		}
	}
	checkTable(t, tb)
}

// TestTableWrap puts a probe chain across the end of the slots and removes
// from it.
func TestTableWrap(t *testing.T) {
	tb := &table{homeMask: ^uint64(0)}
	tb.reserve() // 16 slots
	c := uint64(len(tb.slots))
	for k := uint64(0); k < 8; k++ {
		put(tb, c-2, k, k, 0) // home c-2: slots c-2, c-1, 0, 1, ...
	}
	put(tb, 1, 100, 100, 0) // home 1, pushed further by the chain
	checkTable(t, tb)
	for _, k := range []uint64{0, 3, 1} {
		del(tb, c-2, k)
		checkTable(t, tb)
	}
	if _, ok := tb.find(1, 100); !ok {
		t.Fatal("key after the wrapped chain lost")
	}
	for k := uint64(0); k < 8; k++ {
		if _, ok := tb.find(c-2, k); ok != (k != 0 && k != 3 && k != 1) {
			t.Fatalf("find(%d) = %v", k, ok)
		}
	}
}

// TestTableGrowth grows a table with colliding and spread keys and checks
// every key after each doubling.
func TestTableGrowth(t *testing.T) {
	for _, homeMask := range []uint64{^uint64(0), 0xff, 7} {
		tb := &table{homeMask: homeMask}
		rng := rand.New(rand.NewPCG(1, 2))
		var keys [][2]uint64
		lastCap := 0
		for len(keys) < 20000 {
			k := [2]uint64{rng.Uint64(), rng.Uint64()}
			keys = append(keys, k)
			put(tb, k[0], k[1], uint64(len(keys)), 0)
			if len(tb.slots) != lastCap {
				lastCap = len(tb.slots)
				for v, k := range keys {
					i, ok := tb.find(k[0], k[1])
					if !ok || tb.slots[i].seq() != uint64(v+1) {
						t.Fatalf("homeMask %#x cap %d: key %d lost", homeMask, lastCap, v)
					}
				}
			}
		}
		checkTable(t, tb)
		if tb.n != len(keys) {
			t.Fatalf("n = %d, want %d", tb.n, len(keys))
		}
	}
}

// TestTableModel runs random puts, overwrites, removals, lookups and sweeps
// against a Go map and checks they give the same answers.
func TestTableModel(t *testing.T) {
	for _, homeMask := range []uint64{^uint64(0), 0x3f, 3} {
		t.Run(fmt.Sprintf("homeMask=%#x", homeMask), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(homeMask, 7))
			sh := &shard{t: table{homeMask: homeMask}}
			type val struct {
				v       uint64
				expires int64
			}
			model := map[[2]uint64]val{}
			// A small key space makes overwrites and hits common; a few
			// keys share h0 to exercise the h1 comparison.
			key := func() [2]uint64 {
				k := rng.Uint64N(3000)
				if k < 100 {
					return [2]uint64{7, k}
				}
				return [2]uint64{k * 0x9e3779b97f4a7c15, k ^ 0x5555}
			}
			now := int64(0)
			const ops = 100000
			for op := 0; op < ops; op++ {
				k := key()
				switch r := rng.IntN(100); {
				case r < 40:
					v := rng.Uint64N(1 << 61)
					exp := now + 1 + rng.Int64N(1000)
					put(&sh.t, k[0], k[1], v, exp)
					model[k] = val{v, exp}
				case r < 65:
					_, want := model[k]
					if got := del(&sh.t, k[0], k[1]); got != want {
						t.Fatalf("op %d: remove %v = %v, want %v", op, k, got, want)
					}
					delete(model, k)
				case r < 99:
					i, ok := sh.t.find(k[0], k[1])
					m, want := model[k]
					if ok != want || (ok && (sh.t.slots[i].seq() != m.v || sh.t.slots[i].expires != m.expires)) {
						t.Fatalf("op %d: find %v = %v, want %v", op, k, ok, want)
					}
				default:
					now += rng.Int64N(400)
					sh.removeExpired(now)
					for mk, m := range model {
						if now >= m.expires {
							delete(model, mk)
						}
					}
					checkTable(t, &sh.t)
				}
				if sh.t.n != len(model) {
					t.Fatalf("op %d: n = %d, model has %d", op, sh.t.n, len(model))
				}
				if op%5000 == 0 {
					checkTable(t, &sh.t)
				}
			}
			checkTable(t, &sh.t)
			for k, m := range model {
				if i, ok := sh.t.find(k[0], k[1]); !ok || sh.t.slots[i].seq() != m.v {
					t.Fatalf("end: key %v lost", k)
				}
			}
		})
	}
}

// TestRemoveExpiredShrinks sweeps a large table down to a few keys.
func TestRemoveExpiredShrinks(t *testing.T) {
	sh := &shard{t: table{homeMask: ^uint64(0)}}
	for k := uint64(0); k < 10000; k++ {
		exp := int64(10)
		if k%1000 == 0 {
			exp = 100
		}
		put(&sh.t, k*0x9e3779b97f4a7c15, k, k, exp)
	}
	big := len(sh.t.slots)
	sh.removeExpired(10)
	checkTable(t, &sh.t)
	if sh.t.n != 10 || len(sh.t.slots) >= big || len(sh.t.slots) > 64 {
		t.Fatalf("after sweep: n = %d, cap %d (was %d)", sh.t.n, len(sh.t.slots), big)
	}
	for k := uint64(0); k < 10000; k += 1000 {
		if _, ok := sh.t.find(k*0x9e3779b97f4a7c15, k); !ok {
			t.Fatalf("kept key %d lost", k)
		}
	}
	sh.removeExpired(100)
	if sh.t.n != 0 || sh.t.slots != nil {
		t.Fatalf("after sweeping all: n = %d, cap %d", sh.t.n, len(sh.t.slots))
	}
}

func TestHashFraming(t *testing.T) {
	s, err := New(Options{SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	_, a := s.hash("ab", "c")
	_, b := s.hash("a", "bc")
	if a == b {
		t.Fatal(`("ab","c") and ("a","bc") hash alike`)
	}
	if a[0] == a[1] {
		t.Fatal("the two halves of the hash are equal")
	}
	// The buffer and the streaming paths hash the same bytes alike.
	for _, k := range [][2]string{{"s", "1"}, {"scope", strings.Repeat("x", 100)}} {
		_, h := s.hash(k[0], k[1])
		if want := (hkey{hashLong(s.seeds[0], k[0], k[1]), hashLong(s.seeds[1], k[0], k[1])}); h != want {
			t.Fatalf("%q: buffered hash %x, streamed %x", k, h, want)
		}
	}
	long := strings.Repeat("y", 200)
	_, h1 := s.hash(long, long+"z")
	_, h2 := s.hash(long+"y", long)
	if h1 == h2 {
		t.Fatal("long keys differing in framing hash alike")
	}
}

// TestStoreCollidingChains runs the store with every key of a shard on one
// probe chain: releases and expiries in the middle of the chains must not
// lose the keys after them, nor their results.
func TestStoreCollidingChains(t *testing.T) {
	clock := dedup.NewManualClock(time.Unix(0, 0))
	s, err := New(Options{Clock: clock, Lease: time.Minute, TTL: time.Hour, SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for i := range s.shards {
		s.shards[i].t.homeMask = 0
	}
	ctx := context.Background()
	const n = 3000
	key := func(i int) dedup.Key {
		return dedup.Key{Scope: "s", ID: fmt.Sprint("id-", i), Fingerprint: dedup.FingerprintOf([]byte(fmt.Sprint(i)))}
	}
	leases := make([]*dedup.Lease, n)
	for i := range n {
		l, err := s.Claim(ctx, key(i))
		if err != nil {
			t.Fatal(err)
		}
		leases[i] = l
	}
	// Even keys complete (with a result when divisible by 4); odd keys
	// are released, or stay in flight when divisible by 3.
	for i := range n {
		var err error
		switch {
		case i%2 == 0:
			var res []byte
			if i%4 == 0 {
				res = []byte(fmt.Sprint("result ", i))
			}
			err = s.Complete(ctx, leases[i], res)
		case i%3 != 0:
			err = s.Release(ctx, leases[i])
		}
		if err != nil {
			t.Fatal(i, err)
		}
	}
	check := func(stage string, inFlightLive bool) {
		t.Helper()
		for i := range n {
			l, err := s.Claim(ctx, key(i))
			var ce *dedup.ClaimError
			switch {
			case i%2 == 0:
				if !errors.As(err, &ce) || !errors.Is(err, dedup.ErrDuplicate) {
					t.Fatalf("%s: key %d: %v, want duplicate", stage, i, err)
				}
				want := ""
				if i%4 == 0 {
					want = fmt.Sprint("result ", i)
				}
				if string(ce.Result) != want || (want == "" && ce.Result != nil) {
					t.Fatalf("%s: key %d: result %q, want %q", stage, i, ce.Result, want)
				}
				// A mismatching fingerprint is still reported.
				k := key(i)
				k.Fingerprint[0] ^= 1
				if _, err := s.Claim(ctx, k); !errors.Is(err, dedup.ErrFingerprintMismatch) {
					t.Fatalf("%s: key %d: %v, want mismatch", stage, i, err)
				}
			case i%3 == 0 && inFlightLive:
				if !errors.Is(err, dedup.ErrInFlight) {
					t.Fatalf("%s: key %d: %v, want in flight", stage, i, err)
				}
			default:
				if err != nil {
					t.Fatalf("%s: key %d: %v, want a claim", stage, i, err)
				}
				if err := s.Release(ctx, l); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	check("after releases", true)
	// The in-flight leases expire; the sweeper's pass removes them from
	// the middle of the chains.
	clock.Advance(2 * time.Minute)
	now := s.at(clock.Now())
	for i := range s.shards {
		s.shards[i].removeExpired(now)
	}
	if got, want := s.Len(), (n+1)/2; got != want {
		t.Fatalf("Len after sweep = %d, want %d", got, want)
	}
	for i := range n {
		if i%2 == 1 && i%3 == 0 {
			if err := s.Complete(ctx, leases[i], nil); !errors.Is(err, dedup.ErrLeaseLost) {
				t.Fatalf("stale owner of %d: %v, want ErrLeaseLost", i, err)
			}
		}
	}
	check("after sweep", false)
	for i := range s.shards {
		checkTable(t, &s.shards[i].t)
	}
	// Retention ends: everything goes, results included.
	clock.Advance(2 * time.Hour)
	now = s.at(clock.Now())
	for i := range s.shards {
		s.shards[i].removeExpired(now)
		if len(s.shards[i].results) != 0 {
			t.Fatalf("shard %d keeps %d results", i, len(s.shards[i].results))
		}
	}
	if s.Len() != 0 {
		t.Fatalf("Len = %d after retention", s.Len())
	}
}

// TestExpiredResultNotReused re-claims a result-bearing key after its
// retention without a sweep: its new completion without a result must not
// return the old one.
func TestExpiredResultNotReused(t *testing.T) {
	clock := dedup.NewManualClock(time.Unix(0, 0))
	s, err := New(Options{Clock: clock, TTL: time.Minute, SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	k := dedup.Key{Scope: "s", ID: "1"}
	l, err := s.Claim(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(ctx, l, []byte("old")); err != nil {
		t.Fatal(err)
	}
	clock.Advance(2 * time.Minute)
	if l, err = s.Claim(ctx, k); err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(ctx, l, nil); err != nil {
		t.Fatal(err)
	}
	_, err = s.Claim(ctx, k)
	var ce *dedup.ClaimError
	if !errors.As(err, &ce) || !errors.Is(err, dedup.ErrDuplicate) || ce.Result != nil {
		t.Fatalf("claim = %v, want a duplicate without result", err)
	}
	if s.Len() != 1 {
		t.Fatalf("Len = %d", s.Len())
	}
	n := 0
	for i := range s.shards {
		n += len(s.shards[i].results)
	}
	if n != 0 {
		t.Fatalf("%d results kept", n)
	}
}

func TestSlotSize(t *testing.T) {
	if n := unsafe.Sizeof(slot{}); n != 64 {
		t.Fatalf("slot is %d bytes, want 64 (one cache line)", n)
	}
}
