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
	"github.com/idemkit/idem/internal/seat"
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

// takeWithin takes a seat of g, or fails the test after a second.
func takeWithin(t *testing.T, g *seat.Gate, s *seat.Seat, what string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	if err := g.Take(ctx, s); err != nil {
		t.Fatalf("%s: the only seat was not free: %v", what, err)
	}
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

// TestDedupGivesItsSeatAwayForStoreCalls checks the handler-slot handoff
// (internal/seat): on a gate of one seat, another delivery can take the
// seat while Dedup waits for its claim and for its Complete, and the
// handler runs only once Dedup holds the seat again.
func TestDedupGivesItsSeatAwayForStoreCalls(t *testing.T) {
	g := seat.NewGate(1)
	inClaim, inComplete := make(chan struct{}), make(chan struct{})
	claimGo, completeGo := make(chan struct{}), make(chan struct{})
	hs := &hookStore{countingStore: &countingStore{LeaseStore: newStore(t, memstore.Options{})},
		beforeClaim:    func() { close(inClaim); <-claimGo },
		beforeComplete: func() { close(inComplete); <-completeGo }}
	handled := make(chan struct{})
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		close(handled)
		return nil
	}), mustDedup(t, hs, consumer.DedupOptions{Scope: "s"}))

	var mine, other seat.Seat
	takeWithin(t, g, &mine, "the delivery's own seat")
	res := make(chan consumer.Result, 1)
	go func() {
		defer mine.Leave()
		res <- consumer.Process(seat.With(t.Context(), &mine), h, msg("m1", "p"))
	}()

	<-inClaim
	takeWithin(t, g, &other, "during the claim")
	close(claimGo)
	select {
	case <-handled:
		t.Fatal("the handler ran while another delivery held the only seat")
	case <-time.After(50 * time.Millisecond):
	}
	other.Leave()
	<-handled
	<-inComplete
	takeWithin(t, g, &other, "during Complete")
	close(completeGo)
	wantResult(t, <-res, consumer.ActionAck, "")
	other.Leave()
	if hs.completes.Load() != 1 {
		t.Fatalf("Complete calls = %d, want 1", hs.completes.Load())
	}
}

// seatWaiter is a delivery that claimed its key and waits for the only
// seat of a gate, which another delivery holds.
type seatWaiter struct {
	cs    *hookStore
	ran   atomic.Bool // the handler ran
	res   chan consumer.Result
	other seat.Seat // the seat the delivery waits for, held by the test
}

// waitForSeat starts Process on message m1 (payload "p") under Dedup over
// store with opts, with ctx, on a gate of one seat, and returns once the
// claim went through while the test holds that seat.
func waitForSeat(ctx context.Context, t *testing.T, store dedup.LeaseStore, opts consumer.DedupOptions) *seatWaiter {
	t.Helper()
	w := &seatWaiter{res: make(chan consumer.Result, 1)}
	claimed, claimGo := make(chan struct{}), make(chan struct{})
	w.cs = &hookStore{countingStore: &countingStore{LeaseStore: store}, beforeClaim: func() { close(claimed); <-claimGo }}
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		w.ran.Store(true)
		return nil
	}), mustDedup(t, w.cs, opts))
	g := seat.NewGate(1)
	var mine seat.Seat
	takeWithin(t, g, &mine, "the delivery's own seat")
	go func() {
		defer mine.Leave()
		w.res <- consumer.Process(seat.With(ctx, &mine), h, msg("m1", "p"))
	}()
	<-claimed
	takeWithin(t, g, &w.other, "during the claim")
	t.Cleanup(w.other.Leave)
	close(claimGo)
	testenv.Eventually(t, 5*time.Second, "the claim", func() bool { return w.cs.claims.Load() > 0 })
	return w
}

// TestDedupSeatWaitKeepsTheLease: a delivery that waits for a handler slot
// after its claim is under the heartbeat like a running handler. When the
// lease is lost meanwhile, the handler never runs and the store is not
// touched again (the new owner's lease stays intact); when the handler
// context ends meanwhile, the lease is released at once.
func TestDedupSeatWaitKeepsTheLease(t *testing.T) {
	t.Run("lost", func(t *testing.T) {
		clock := clocktest.NewManual(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
		store := newStore(t, memstore.Options{Lease: time.Second, Clock: clock})
		w := waitForSeat(t.Context(), t, store, consumer.DedupOptions{Scope: "s", ExtendEvery: 2 * time.Millisecond})
		// Let a few beats pass: the lease must be kept while waiting.
		testenv.Eventually(t, 5*time.Second, "three heartbeats while waiting for the seat", func() bool { return w.cs.extends.Load() >= 3 })
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
		w := waitForSeat(ctx, t, store, consumer.DedupOptions{Scope: "s"})
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

// A handler that runs Dedup-wrapped work of its own in goroutines does not
// move its delivery's seat: the sub-handlers see no seat, and when the
// delivery leaves, every seat of the gate is free again.
func TestDedupHidesTheSeatFromItsHandler(t *testing.T) {
	store := newStore(t, memstore.Options{})
	inner := mustDedup(t, store, consumer.DedupOptions{Scope: "inner"})
	var sawSeat atomic.Int64
	sub := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
		if seat.From(ctx) != nil {
			sawSeat.Add(1)
		}
		return nil
	}), inner)
	outer := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if seat.From(ctx) != nil {
			sawSeat.Add(1)
		}
		var wg sync.WaitGroup
		for i := range 4 {
			wg.Go(func() {
				if r := consumer.Process(ctx, sub, msg(fmt.Sprintf("%s-%d", m.ID, i), "p")); r.Action != consumer.ActionAck {
					t.Errorf("sub-handler %d: %+v", i, r)
				}
			})
		}
		wg.Wait()
		return nil
	}), mustDedup(t, store, consumer.DedupOptions{Scope: "outer"}))
	const size = 2
	g := seat.NewGate(size)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			var st seat.Seat
			if err := g.Take(t.Context(), &st); err != nil {
				t.Error(err)
				return
			}
			defer st.Leave()
			if r := consumer.Process(seat.With(t.Context(), &st), outer, msg(fmt.Sprintf("m%d", i), "p")); r.Action != consumer.ActionAck {
				t.Errorf("delivery %d: %+v", i, r)
			}
		})
	}
	wg.Wait()
	if n := sawSeat.Load(); n != 0 {
		t.Errorf("handlers saw their delivery's seat %d times", n)
	}
	var all [size]seat.Seat
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	defer func() {
		for i := range all {
			all[i].Leave()
		}
	}()
	for i := range all {
		if err := g.Take(ctx, &all[i]); err != nil {
			t.Fatalf("seat %d of %d is not free after every delivery left: %v", i+1, size, err)
		}
	}
}

// Without a heartbeat nothing extends the lease while the delivery waits
// for a handler slot: the wait is bounded by half of the lease, and then
// the key is released without the handler running.
func TestDedupSeatWaitWithoutHeartbeat(t *testing.T) {
	store := newStore(t, memstore.Options{Lease: 200 * time.Millisecond})
	w := waitForSeat(t.Context(), t, store, consumer.DedupOptions{Scope: "s", ExtendEvery: -1})
	r := resultWithin(t, w.res)
	if r.Action != consumer.ActionRetry || w.ran.Load() {
		t.Fatalf("result %+v, handler ran %v; want a retry without the handler", r, w.ran.Load())
	}
	if w.cs.releases.Load() != 1 {
		t.Fatalf("Release calls = %d, want 1", w.cs.releases.Load())
	}
}
