package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/testkit/clocktest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// hookStore runs a hook before each Claim and Complete it passes on.
type hookStore struct {
	*countingStore
	beforeClaim, beforeComplete func()
}

func (s *hookStore) Claim(ctx context.Context, k dedup.Key) (*dedup.Lease, error) {
	if s.beforeClaim != nil {
		s.beforeClaim()
	}
	return s.countingStore.Claim(ctx, k)
}

func (s *hookStore) Complete(ctx context.Context, l *dedup.Lease, r []byte) error {
	if s.beforeComplete != nil {
		s.beforeComplete()
	}
	return s.countingStore.Complete(ctx, l, r)
}

// testGate is a set of handler slots like an adapter's: at most its
// capacity are held at once.
type testGate chan struct{}

// testSlot is one delivery's slot of a testGate (consumer.Message.Slot). It
// counts the calls of Away and Back.
type testSlot struct {
	g           testGate
	mu          sync.Mutex
	held        bool
	aways, back atomic.Int64
}

// take waits for a slot of g and returns it held.
func (g testGate) take(ctx context.Context) (*testSlot, error) {
	select {
	case g <- struct{}{}:
		return &testSlot{g: g, held: true}, nil
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
}

func (s *testSlot) Away() {
	s.aways.Add(1)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held {
		s.held = false
		<-s.g
	}
}

func (s *testSlot) Back(ctx context.Context) error {
	s.back.Add(1)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held {
		return nil
	}
	select {
	case s.g <- struct{}{}:
		s.held = true
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

func (s *testSlot) isHeld() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.held
}

// leave gives the slot up for good.
func (s *testSlot) leave() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held {
		s.held = false
		<-s.g
	}
}

// takeWithin takes a slot of g, or fails the test after a second.
func takeWithin(t *testing.T, g testGate, what string) *testSlot {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	s, err := g.take(ctx)
	if err != nil {
		t.Fatalf("%s: the only slot was not free: %v", what, err)
	}
	return s
}

// withSlot is m with the handler slot s attached.
func withSlot(m *consumer.Message, s *testSlot) *consumer.Message {
	m.Slot = s
	return m
}

// resultWithin receives a result, or fails the test after five seconds.
func resultWithin(t *testing.T, res <-chan consumer.Result) consumer.Result {
	t.Helper()
	select {
	case r := <-res:
		return r
	case <-time.After(5 * time.Second):
		t.Fatal("no result after 5s")
		return consumer.Result{}
	}
}

// TestDedupGivesItsSlotAwayForStoreCalls checks the handler-slot handoff
// (Message.Slot): on a gate of one slot, another delivery can take the
// slot while Dedup waits for its claim and for its Complete, and the
// handler runs only once Dedup holds the slot again.
func TestDedupGivesItsSlotAwayForStoreCalls(t *testing.T) {
	g := make(testGate, 1)
	inClaim, inComplete := make(chan struct{}), make(chan struct{})
	claimGo, completeGo := make(chan struct{}), make(chan struct{})
	hs := &hookStore{countingStore: &countingStore{LeaseStore: newStore(t, memstore.Options{})},
		beforeClaim:    func() { close(inClaim); <-claimGo },
		beforeComplete: func() { close(inComplete); <-completeGo }}
	mine := takeWithin(t, g, "the delivery's own slot")
	handled := make(chan struct{})
	var heldInHandler atomic.Bool
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		heldInHandler.Store(mine.isHeld())
		close(handled)
		return nil
	}), mustDedup(t, hs, consumer.DedupOptions{Scope: "s"}))

	res := make(chan consumer.Result, 1)
	go func() {
		defer mine.leave()
		res <- consumer.Process(t.Context(), h, withSlot(msg("m1", "p"), mine))
	}()

	<-inClaim
	other := takeWithin(t, g, "during the claim")
	close(claimGo)
	select {
	case <-handled:
		t.Fatal("the handler ran while another delivery held the only slot")
	case <-time.After(50 * time.Millisecond):
	}
	other.leave()
	<-handled
	if !heldInHandler.Load() {
		t.Fatal("the handler ran without its delivery's slot")
	}
	<-inComplete
	other = takeWithin(t, g, "during Complete")
	close(completeGo)
	wantResult(t, <-res, consumer.ActionAck, "")
	other.leave()
	if hs.completes.Load() != 1 {
		t.Fatalf("Complete calls = %d, want 1", hs.completes.Load())
	}
}

// slotWaiter is a delivery that claimed its key and waits for the only
// slot of a gate, which another delivery holds.
type slotWaiter struct {
	cs  *hookStore
	ran atomic.Bool // the handler ran
	res chan consumer.Result
}

// waitForSlot starts Process on message m1 (payload "p") under Dedup over
// store with opts, with ctx, on a gate of one slot, and returns once the
// claim went through while the test holds that slot.
func waitForSlot(ctx context.Context, t *testing.T, store dedup.LeaseStore, opts consumer.DedupOptions) *slotWaiter {
	t.Helper()
	w := &slotWaiter{res: make(chan consumer.Result, 1)}
	claimed, claimGo := make(chan struct{}), make(chan struct{})
	w.cs = &hookStore{countingStore: &countingStore{LeaseStore: store}, beforeClaim: func() { close(claimed); <-claimGo }}
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		w.ran.Store(true)
		return nil
	}), mustDedup(t, w.cs, opts))
	g := make(testGate, 1)
	mine := takeWithin(t, g, "the delivery's own slot")
	go func() {
		defer mine.leave()
		w.res <- consumer.Process(ctx, h, withSlot(msg("m1", "p"), mine))
	}()
	<-claimed
	other := takeWithin(t, g, "during the claim")
	t.Cleanup(other.leave)
	close(claimGo)
	testenv.Eventually(t, 5*time.Second, "the claim", func() bool { return w.cs.claims.Load() > 0 })
	return w
}

// TestDedupSlotWaitKeepsTheLease: a delivery that waits for a handler slot
// after its claim is under the heartbeat like a running handler. When the
// lease is lost meanwhile, the handler never runs and the store is not
// touched again (the new owner's lease stays intact); when the handler
// context ends meanwhile, the lease is released at once.
func TestDedupSlotWaitKeepsTheLease(t *testing.T) {
	t.Run("lost", func(t *testing.T) {
		clock := clocktest.NewManual(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
		store := newStore(t, memstore.Options{Lease: time.Second, Clock: clock})
		w := waitForSlot(t.Context(), t, store, consumer.DedupOptions{Scope: "s", ExtendEvery: 2 * time.Millisecond})
		// Let a few beats pass: the lease must be kept while waiting.
		testenv.Eventually(t, 5*time.Second, "three heartbeats while waiting for the slot", func() bool { return w.cs.extends.Load() >= 3 })
		clock.Advance(2 * time.Second)
		second, err := store.Claim(t.Context(), dedup.NewKey("s", "m1", []byte("p")))
		if err != nil {
			t.Fatalf("second owner's claim after expiry = %v, want a lease", err)
		}
		wantResult(t, resultWithin(t, w.res), consumer.ActionRetry, consumer.OutcomeLeaseLost)
		if w.ran.Load() {
			t.Fatal("the handler ran after its lease was lost")
		}
		if w.cs.releases.Load() != 0 || w.cs.completes.Load() != 0 {
			t.Fatalf("stale owner called Release %d and Complete %d times, want 0", w.cs.releases.Load(), w.cs.completes.Load())
		}
		if err := store.Complete(t.Context(), second, nil); err != nil {
			t.Fatalf("second owner's Complete = %v", err)
		}
	})
	t.Run("stopped", func(t *testing.T) {
		store := newStore(t, memstore.Options{})
		ctx, cancel := context.WithCancel(t.Context())
		w := waitForSlot(ctx, t, store, consumer.DedupOptions{Scope: "s"})
		cancel()
		r := resultWithin(t, w.res)
		if r.Action != consumer.ActionRetry || !errors.Is(r.Err, context.Canceled) {
			t.Fatalf("result = %+v, want a retry caused by the cancelled context", r)
		}
		if w.ran.Load() {
			t.Fatal("the handler ran after its context ended")
		}
		if w.cs.releases.Load() != 1 {
			t.Fatalf("Release calls = %d, want 1", w.cs.releases.Load())
		}
		// Released: the redelivery claims at once.
		l, err := store.Claim(t.Context(), dedup.NewKey("s", "m1", []byte("p")))
		if err != nil {
			t.Fatalf("claim after the release = %v, want a lease", err)
		}
		_ = store.Release(t.Context(), l)
	})
}

// A handler that runs Dedup-wrapped work of its own in goroutines, on its
// own message and on copies of it, does not move its delivery's slot: only the
// outer Dedup gives it up (before the claim and after the handler) and
// takes it back (once), the slot is held while the handler runs, and when
// the delivery leaves, every slot of the gate is free again.
func TestDedupHidesTheSlotFromItsHandler(t *testing.T) {
	store := newStore(t, memstore.Options{})
	inner := mustDedup(t, store, consumer.DedupOptions{Scope: "inner"})
	sub := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }), inner)
	outer := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		st := m.Slot.(*testSlot)
		var wg sync.WaitGroup
		for i := range 4 {
			wg.Go(func() {
				sm := m // the delivery's own message, with its slot
				if i > 0 {
					// Work derived from it: a copy, the slot included.
					c := *m
					c.ID = fmt.Sprintf("%s-%d", m.ID, i)
					sm = &c
				}
				if r := consumer.Process(ctx, sub, sm); r.Action != consumer.ActionAck {
					t.Errorf("sub-handler %d: %+v", i, r)
				}
				if !st.isHeld() {
					t.Errorf("sub-handler %d: the delivery's slot was given up under the handler", i)
				}
			})
		}
		wg.Wait()
		return nil
	}), mustDedup(t, store, consumer.DedupOptions{Scope: "outer"}))
	const size = 2
	g := make(testGate, size)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			st, err := g.take(t.Context())
			if err != nil {
				t.Error(err)
				return
			}
			defer st.leave()
			if r := consumer.Process(t.Context(), outer, withSlot(msg(fmt.Sprintf("m%d", i), "p"), st)); r.Action != consumer.ActionAck {
				t.Errorf("delivery %d: %+v", i, r)
			}
			if a, b := st.aways.Load(), st.back.Load(); a != 2 || b != 1 {
				t.Errorf("delivery %d: Away called %d times and Back %d times, want 2 and 1 (by the outer Dedup only)", i, a, b)
			}
		})
	}
	wg.Wait()
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	for i := range size {
		st, err := g.take(ctx)
		if err != nil {
			t.Fatalf("slot %d of %d is not free after every delivery left: %v", i+1, size, err)
		}
		t.Cleanup(st.leave)
	}
}

// Transactional keeps the delivery's handler slot while its handler runs:
// a Dedup the handler runs on the same message does not give it up.
func TestTransactionalKeepsTheSlot(t *testing.T) {
	inner := mustDedup(t, newStore(t, memstore.Options{}), consumer.DedupOptions{Scope: "inner"})
	sub := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }), inner)
	h, err := consumer.Transactional(newTxStore(), consumer.TxOptions{Scope: "tx"}, func(ctx context.Context, _ *fakeTx, m *consumer.Message) error {
		if r := consumer.Process(ctx, sub, m); r.Action != consumer.ActionAck {
			t.Errorf("sub-handler: %+v", r)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	g := make(testGate, 1)
	st := takeWithin(t, g, "the delivery's slot")
	defer st.leave()
	wantResult(t, consumer.Process(t.Context(), h, withSlot(msg("m1", "p"), st)), consumer.ActionAck, "")
	if a, b := st.aways.Load(), st.back.Load(); a != 0 || b != 0 || !st.isHeld() {
		t.Fatalf("Away called %d times, Back %d times, held %v; want 0, 0, true", a, b, st.isHeld())
	}
}

// Without a heartbeat nothing extends the lease while the delivery waits
// for a handler slot: the wait is bounded by half of the lease, and then
// the key is released without the handler running.
func TestDedupSlotWaitWithoutHeartbeat(t *testing.T) {
	store := newStore(t, memstore.Options{Lease: 200 * time.Millisecond})
	w := waitForSlot(t.Context(), t, store, consumer.DedupOptions{Scope: "s", ExtendEvery: -1})
	r := resultWithin(t, w.res)
	if r.Action != consumer.ActionRetry || w.ran.Load() {
		t.Fatalf("result %+v, handler ran %v; want a retry without the handler", r, w.ran.Load())
	}
	if w.cs.releases.Load() != 1 {
		t.Fatalf("Release calls = %d, want 1", w.cs.releases.Load())
	}
}
