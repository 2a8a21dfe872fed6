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
	"github.com/idemkit/idem/internal/testkit/linear/scenario"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

const slack = scenario.Slack

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
// come back and done marks expire; scenario.Memstore) is linearizable
// under LeaseModel.
func TestMemstoreLinearizable(t *testing.T) {
	o, err := scenario.Memstore(testenv.Ctx(t), scenario.Size{})
	if err != nil {
		t.Fatal(err)
	}
	linear.Check(t, o.Name, o.Model, o.History)
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
// checked to exist) with its sub-history. The clients follow a script
// that meets the fault whatever the machine's load: a second claim right
// after the first, well inside a lease of seconds; a stale owner
// completing after its lease ran out and another owner claimed the key.
func TestCheckerCatchesBrokenStores(t *testing.T) {
	for _, tc := range []struct {
		name  string
		lease time.Duration
		stale bool
		store func(*memstore.Store) dedup.LeaseStore
	}{
		{"claim grants two owners", 5 * time.Second, false,
			func(s *memstore.Store) dedup.LeaseStore { return doubleGrant{s} }},
		{"complete ignores the token", 100 * time.Millisecond, true, func(s *memstore.Store) dedup.LeaseStore {
			return &tokenBlind{LeaseStore: s, current: map[string]*dedup.Lease{}}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("IDEM_LINEAR_DIR", t.TempDir())
			// The script on the store itself is linearizable: the
			// violation below is the broken store's.
			linear.Check(t, "memstore, "+tc.name+" script", linear.LeaseModel(tc.lease, tc.lease, slack),
				scriptedOwners(t, newMemstore(t, tc.lease, tc.lease), tc.lease, tc.stale))
			s := tc.store(newMemstore(t, tc.lease, tc.lease))
			h := scriptedOwners(t, s, tc.lease, tc.stale)
			v := linear.Find(t, tc.name, linear.LeaseModel(tc.lease, tc.lease, slack), h.Operations())
			if v == nil {
				t.Fatalf("no violation in %d operations (%v)", len(h.Operations()), h.Counts())
			}
			if _, err := os.Stat(v.Path); err != nil {
				t.Fatalf("violation on key %s, but its visualization: %v", v.Key, err)
			}
			if v.SubHistory == "" {
				t.Fatalf("violation on key %s without a sub-history", v.Key)
			}
			t.Logf("violation on key %s, visualization %s\n%s", v.Key, v.Path, v.SubHistory)
		})
	}
}

// scriptedOwners records two clients on one key: client 0 claims it;
// with stale, waits three leases; client 1 claims it; with stale, client 0
// then completes its own (expired) lease.
func scriptedOwners(t *testing.T, s dedup.LeaseStore, lease time.Duration, stale bool) *linear.History {
	ctx := testenv.Ctx(t)
	h := linear.NewHistory()
	k := dedup.Key{Scope: testenv.UniqueID("broken"), ID: "k0"}
	claim := func(c int) *dedup.Lease {
		in := linear.Input{Kind: linear.Claim, Key: k.ID, Call: h.Now()}
		l, err := s.Claim(ctx, k)
		h.Add(c, in, linear.ClaimOutput(l, err), h.Now())
		if err != nil && !errors.Is(err, dedup.ErrInFlight) {
			t.Fatalf("client %d: claim: %v", c, err)
		}
		return l
	}
	first := claim(0)
	if first == nil {
		t.Fatal("client 0 was not granted the fresh key")
	}
	if stale {
		time.Sleep(3 * lease)
	}
	claim(1)
	if stale {
		in := linear.Input{Kind: linear.Complete, Key: k.ID, Token: first.Token, Call: h.Now()}
		err := s.Complete(ctx, first, nil)
		h.Add(0, in, linear.LeaseOutput(err), h.Now())
	}
	return h
}
