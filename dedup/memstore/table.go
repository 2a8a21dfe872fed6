package memstore

import "github.com/idemkit/idem/dedup"

// slot is one entry of a table: 64 bytes, one cache line in the page-aligned
// slices of all but the smallest tables. It holds no pointers, so a table's
// slice is allocated without pointer bits and the collector never scans it.
// A key is represented only by its 128-bit hash (h0, h1).
type slot struct {
	h0, h1 uint64
	// meta is the owner's token number while in flight (0 when done)
	// shifted left by 3, metaResult, and the state in the low two bits.
	// An empty slot has meta 0.
	meta    uint64
	expires int64 // lease expiry while in flight, retention end when done (Store.at)
	fp      dedup.Fingerprint
}

const (
	metaState  = 3 // the bits of meta that hold the state
	metaResult = 4 // the shard's results map holds this key's result
	metaShift  = 3 // the token number is meta >> metaShift
)

// inFlightMeta is the meta of a slot in flight for the token number seq.
// Token numbers count claims from 1, so they never reach 2^61.
func inFlightMeta(seq uint64) uint64 { return seq<<metaShift | uint64(inFlight) }

func (s *slot) state() state    { return state(s.meta & metaState) }
func (s *slot) seq() uint64     { return s.meta >> metaShift }
func (s *slot) hasResult() bool { return s.meta&metaResult != 0 }
func (s *slot) empty() bool     { return s.meta == 0 }

// minCap is the capacity of a table's first allocation.
const minCap = 16

// table is an open-addressing hash table of slots with linear probing,
// a power-of-two capacity and backward-shift deletion (no tombstones): a key
// is always found before the first empty slot after its home index. It grows
// by doubling before an insert would take it past a load factor of 3/4,
// rehashing from the stored hashes. The zero value is an empty table.
type table struct {
	slots []slot
	n     int // occupied slots
	// homeMask is ANDed into h0 to get the home index. It is all ones
	// except in tests, which narrow it to force keys onto the same probe
	// chains.
	homeMask uint64
}

func (t *table) home(h0 uint64) int {
	return int(h0 & t.homeMask & uint64(len(t.slots)-1))
}

// find returns the index of the key (h0, h1) and true, or, when the table
// does not hold it, the index of the empty slot an insert should use and
// false. The table must not be empty (call reserve first) unless the caller
// only looks the key up: find returns -1, false for an unallocated table.
func (t *table) find(h0, h1 uint64) (int, bool) {
	if len(t.slots) == 0 {
		return -1, false
	}
	mask := len(t.slots) - 1
	for i := t.home(h0); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.empty() {
			return i, false
		}
		if s.h0 == h0 && s.h1 == h1 {
			return i, true
		}
	}
}

// reserve makes room for one more slot, so that the index find returns for
// an absent key can take it without exceeding the load factor.
func (t *table) reserve() {
	if (t.n+1)*4 > len(t.slots)*3 {
		c := len(t.slots) * 2
		if c < minCap {
			c = minCap
		}
		t.resize(c)
	}
}

// resize rehashes every slot into a table of capacity c, a power of two
// that holds t.n slots within the load factor.
func (t *table) resize(c int) {
	old := t.slots
	t.slots = make([]slot, c)
	mask := c - 1
	for i := range old {
		if old[i].empty() {
			continue
		}
		j := t.home(old[i].h0)
		for !t.slots[j].empty() {
			j = (j + 1) & mask
		}
		t.slots[j] = old[i]
	}
}

// remove empties slot i, shifting the following slots of its probe chain back
// so that every remaining key stays reachable from its home index.
func (t *table) remove(i int) {
	mask := len(t.slots) - 1
	for j := (i + 1) & mask; !t.slots[j].empty(); j = (j + 1) & mask {
		// The slot at j may move to the hole at i only if i lies on its
		// probe path, from its home index up to j.
		if (j-t.home(t.slots[j].h0))&mask >= (j-i)&mask {
			t.slots[i] = t.slots[j]
			i = j
		}
	}
	t.slots[i] = slot{}
	t.n--
}

// shrink reduces the capacity when at most 1/8 of it is in use, to a load
// of at most 1/4, so that a burst of keys does not pin its memory once swept
// and the next few inserts do not grow it back at once.
func (t *table) shrink() {
	if t.n == 0 {
		t.slots = nil
		return
	}
	if len(t.slots) <= minCap || t.n*8 > len(t.slots) {
		return
	}
	c := len(t.slots)
	for c > minCap && t.n*8 <= c {
		c /= 2
	}
	t.resize(c)
}
