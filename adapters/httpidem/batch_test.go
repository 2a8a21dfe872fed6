package httpidem

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
)

// gatedStore holds its first Claim until gate is closed, so that the claims
// behind it queue up, and records the batches it is sent.
type gatedStore struct {
	*memstore.Store
	gate    chan struct{}
	entered chan struct{}
	once    sync.Once
	mu      sync.Mutex
	batches [][]dedup.Key
	claims  []dedup.Key // single claims after the gated first one
	fail    error
}

func (s *gatedStore) Claim(ctx context.Context, k dedup.Key) (*dedup.Lease, error) {
	first := false
	s.once.Do(func() { first = true; close(s.entered); <-s.gate })
	if !first {
		s.mu.Lock()
		s.claims = append(s.claims, k)
		s.mu.Unlock()
		if s.fail != nil {
			return nil, s.fail
		}
	}
	return s.Store.Claim(ctx, k)
}

func (s *gatedStore) ClaimBatch(ctx context.Context, keys []dedup.Key) ([]dedup.BatchResult, error) {
	s.mu.Lock()
	s.batches = append(s.batches, append([]dedup.Key(nil), keys...))
	s.mu.Unlock()
	if s.fail != nil {
		return nil, s.fail
	}
	return s.Store.ClaimBatch(ctx, keys)
}

func newGated(t *testing.T) *gatedStore {
	m, err := memstore.New(memstore.Options{SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Close() })
	return &gatedStore{Store: m, gate: make(chan struct{}), entered: make(chan struct{})}
}

// queue starts n claims behind the gated first one and waits until they
// all wait in the batcher.
func queueClaims(t *testing.T, b *batcher, s *gatedStore, keys []dedup.Key) ([]*dedup.Lease, []error) {
	t.Helper()
	leases := make([]*dedup.Lease, len(keys)+1)
	errs := make([]error, len(keys)+1)
	var wg sync.WaitGroup
	wg.Go(func() { leases[0], errs[0] = b.claim(context.Background(), dedup.Key{Scope: "s", ID: "gate"}) })
	<-s.entered
	for i, k := range keys {
		wg.Go(func() { leases[i+1], errs[i+1] = b.claim(context.Background(), k) })
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		b.mu.Lock()
		n := len(b.queue)
		b.mu.Unlock()
		if n == len(keys) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d claims queued", n, len(keys))
		}
		time.Sleep(time.Millisecond)
	}
	close(s.gate)
	wg.Wait()
	return leases[1:], errs[1:]
}

func TestBatcherGroupsWaitingClaims(t *testing.T) {
	s := newGated(t)
	b := &batcher{store: s, lanes: 1, timeout: 5 * time.Second}
	var keys []dedup.Key
	for i := range 10 {
		keys = append(keys, dedup.Key{Scope: "s", ID: fmt.Sprint("distinct-", i)})
	}
	for range 20 { // a retry storm on one key
		keys = append(keys, dedup.Key{Scope: "s", ID: "hot"})
	}
	leases, errs := queueClaims(t, b, s, keys)
	if len(s.batches) != 1 || len(s.batches[0]) != 11 {
		t.Fatalf("batches %v: want one batch of the 10 distinct keys and the hot key once", s.batches)
	}
	var won, inFlight int
	for i, k := range keys {
		switch {
		case errs[i] == nil && leases[i] != nil && leases[i].Key == k:
			if k.ID == "hot" {
				won++
			}
		case k.ID == "hot" && errors.Is(errs[i], dedup.ErrInFlight):
			inFlight++
		default:
			t.Fatalf("claim of %s: %v, %v", k, leases[i], errs[i])
		}
	}
	if won != 1 || inFlight != 19 {
		t.Fatalf("hot key: %d leases, %d in flight; want 1 and 19", won, inFlight)
	}
	// Nothing is left in flight in the batcher.
	if b.busy != 0 || len(b.queue) != 0 {
		t.Fatalf("busy %d, queue %d", b.busy, len(b.queue))
	}
	// A completed key answers every copy with the duplicate.
	for i, k := range keys[:1] {
		if err := s.Complete(context.Background(), leases[i], []byte("done")); err != nil {
			t.Fatal(err)
		}
		s2 := newGated(t)
		s2.Store = s.Store
		b2 := &batcher{store: s2, lanes: 1, timeout: 5 * time.Second}
		_, errs := queueClaims(t, b2, s2, []dedup.Key{k, k, k})
		for _, err := range errs {
			if res, ok := dedup.StoredResult(err); !ok || string(res) != "done" {
				t.Fatalf("copy of a completed key: %v", err)
			}
		}
	}
}

func TestBatcherStoreFailure(t *testing.T) {
	s := newGated(t)
	s.fail = errors.New("redis: connection refused")
	b := &batcher{store: s, lanes: 1, timeout: 5 * time.Second}
	_, errs := queueClaims(t, b, s, []dedup.Key{{Scope: "s", ID: "a"}, {Scope: "s", ID: "b"}})
	for _, err := range errs {
		if err == nil || !errors.Is(err, s.fail) {
			t.Fatalf("claim in a failed batch: %v", err)
		}
	}
}

func TestBatcherUnderLoad(t *testing.T) {
	m, err := memstore.New(memstore.Options{SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	b := &batcher{store: m, lanes: 2, timeout: 5 * time.Second}
	var leases atomic.Int64
	var wg sync.WaitGroup
	for i := range 400 {
		wg.Go(func() {
			l, err := b.claim(context.Background(), dedup.Key{Scope: "s", ID: fmt.Sprint(i % 40)})
			if err == nil && l != nil {
				leases.Add(1)
			} else if !errors.Is(err, dedup.ErrInFlight) {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if leases.Load() != 40 {
		t.Fatalf("%d leases for 40 keys", leases.Load())
	}
}

// A batch that holds one key only, however many copies (the replays of a
// hot key), is sent as one plain Claim; its copies get what a batch would
// have given them.
func TestBatcherOneKeyIsOneClaim(t *testing.T) {
	s := newGated(t)
	b := &batcher{store: s, lanes: 1, timeout: 5 * time.Second}
	hot := dedup.Key{Scope: "s", ID: "hot"}
	leases, errs := queueClaims(t, b, s, []dedup.Key{hot, hot, hot, hot})
	if len(s.batches) != 0 || len(s.claims) != 1 || s.claims[0] != hot {
		t.Fatalf("batches %v, claims %v: want one Claim of the hot key", s.batches, s.claims)
	}
	checkCopies(t, []dedup.Key{hot, hot, hot, hot}, leases, errs)
	// A failed claim fails every copy.
	s2 := newGated(t)
	s2.fail = errors.New("redis: connection refused")
	b2 := &batcher{store: s2, lanes: 1, timeout: 5 * time.Second}
	_, errs = queueClaims(t, b2, s2, []dedup.Key{hot, hot})
	for _, err := range errs {
		if !errors.Is(err, s2.fail) {
			t.Fatalf("copy in a failed claim: %v", err)
		}
	}
}

// A small batch finds the copies of its keys by a scan: the same answers
// as the map of a large one.
func TestBatcherSmallBatchCopies(t *testing.T) {
	s := newGated(t)
	b := &batcher{store: s, lanes: 1, timeout: 5 * time.Second}
	a, c := dedup.Key{Scope: "s", ID: "a"}, dedup.Key{Scope: "s", ID: "c"}
	keys := []dedup.Key{a, c, a, c, a}
	leases, errs := queueClaims(t, b, s, keys)
	if len(s.batches) != 1 || len(s.batches[0]) != 2 || s.batches[0][0] == s.batches[0][1] {
		t.Fatalf("batches %v: want one batch of a and c", s.batches)
	}
	checkCopies(t, keys, leases, errs)
}

// checkCopies checks the answers to claims of keys sent together: one lease
// per distinct key, in flight for every other copy.
func checkCopies(t *testing.T, keys []dedup.Key, leases []*dedup.Lease, errs []error) {
	t.Helper()
	won := map[dedup.Key]int{}
	for i, k := range keys {
		switch {
		case errs[i] == nil && leases[i] != nil && leases[i].Key == k:
			won[k]++
		case leases[i] != nil || !errors.Is(errs[i], dedup.ErrInFlight):
			t.Fatalf("claim %d of %s: %v, %v; want a lease or in flight", i, k, leases[i], errs[i])
		}
	}
	for _, k := range keys {
		if won[k] != 1 {
			t.Fatalf("%s: %d leases, want 1", k, won[k])
		}
	}
}
