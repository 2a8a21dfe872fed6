package linear_test

import (
	"context"
	"errors"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/testkit/linear"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// slack covers the difference between a store's clock and the history's,
// and the stores' rounding of expiries to milliseconds.
const slack = 20 * time.Millisecond

func newMemstore(t *testing.T, lease, ttl time.Duration) *memstore.Store {
	t.Helper()
	s, err := memstore.New(memstore.Options{Lease: lease, TTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// TestMemstoreLinearizable: the history of eight clients on three keys of a
// memstore (lease and retention of 100ms, so leases run out, stale owners
// come back and done marks expire) is linearizable under LeaseModel.
func TestMemstoreLinearizable(t *testing.T) {
	const lease, ttl = 100 * time.Millisecond, 100 * time.Millisecond
	s := newMemstore(t, lease, ttl)
	w := linear.Workload{Scope: testenv.UniqueID("mem"), Lease: lease, TTL: ttl}
	h := linear.RunLease(testenv.Ctx(t), linear.Target{Store: s}, w, nil)
	linear.Check(t, "memstore", linear.LeaseModel(lease, ttl, slack), h)
}

// doubleGrant is a broken store: a claim that finds the key in flight is
// granted a lease anyway, a second owner.
type doubleGrant struct{ dedup.LeaseStore }

func (d doubleGrant) Claim(ctx context.Context, k dedup.Key) (*dedup.Lease, error) {
	l, err := d.LeaseStore.Claim(ctx, k)
	if errors.Is(err, dedup.ErrInFlight) {
		return &dedup.Lease{Key: k, Token: testenv.UniqueID("second-owner")}, nil
	}
	return l, err
}

// tokenBlind is a broken store: Complete ignores the caller's token and
// completes whichever lease holds the key.
type tokenBlind struct {
	dedup.LeaseStore
	mu      sync.Mutex
	current map[string]*dedup.Lease // by key id: the last lease granted
}

func (b *tokenBlind) Claim(ctx context.Context, k dedup.Key) (*dedup.Lease, error) {
	l, err := b.LeaseStore.Claim(ctx, k)
	if err == nil {
		b.mu.Lock()
		b.current[k.ID] = l
		b.mu.Unlock()
	}
	return l, err
}

func (b *tokenBlind) Complete(ctx context.Context, l *dedup.Lease, result []byte) error {
	b.mu.Lock()
	cur := b.current[l.Key.ID]
	b.mu.Unlock()
	if cur != nil {
		l = cur
	}
	return b.LeaseStore.Complete(ctx, l, result)
}

// TestCheckerCatchesBrokenStores: the check finds a violation in the
// history of a store that grants a second owner, and of one whose Complete
// ignores the token; a violation is saved as a visualization (the file is
// checked to exist) with its sub-history. Each run is repeated up to three
// times: a violation needs the workload to meet the fault (a claim of a
// held key; a stale owner completing while another owner holds the key),
// which every run so far did at its first try.
func TestCheckerCatchesBrokenStores(t *testing.T) {
	const lease, ttl = 100 * time.Millisecond, 100 * time.Millisecond
	for _, tc := range []struct {
		name  string
		store func(*memstore.Store) dedup.LeaseStore
	}{
		{"claim grants two owners", func(s *memstore.Store) dedup.LeaseStore { return doubleGrant{s} }},
		{"complete ignores the token", func(s *memstore.Store) dedup.LeaseStore {
			return &tokenBlind{LeaseStore: s, current: map[string]*dedup.Lease{}}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("IDEM_LINEAR_DIR", t.TempDir())
			model := linear.LeaseModel(lease, ttl, slack)
			for try := 1; try <= 3; try++ {
				s := tc.store(newMemstore(t, lease, ttl))
				w := linear.Workload{Scope: testenv.UniqueID("broken"), Lease: lease, TTL: ttl}
				h := linear.RunLease(testenv.Ctx(t), linear.Target{Store: s}, w, nil)
				v := linear.Find(t, tc.name, model, h.Operations())
				if v == nil {
					t.Logf("try %d: no violation in %d operations (%v)", try, len(h.Operations()), h.Counts())
					continue
				}
				if _, err := os.Stat(v.Path); err != nil {
					t.Fatalf("violation on key %s, but its visualization: %v", v.Key, err)
				}
				if v.SubHistory == "" {
					t.Fatalf("violation on key %s without a sub-history", v.Key)
				}
				t.Logf("try %d: violation on key %s, visualization %s\n%s", try, v.Key, v.Path, v.SubHistory)
				return
			}
			t.Fatal("three runs of a broken store, and the check found no violation")
		})
	}
}
