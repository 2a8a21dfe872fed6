package seat_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/seat"
)

// TestGateBoundsHolders runs 64 goroutines that each take a seat of a gate
// of 3, give it up and take it back a few times, and counts how many hold a
// seat at once: never more than 3, and 3 at some point.
func TestGateBoundsHolders(t *testing.T) {
	g := seat.NewGate(3)
	var holding, most atomic.Int64
	hold := func() {
		n := holding.Add(1)
		for {
			m := most.Load()
			if n <= m || most.CompareAndSwap(m, n) {
				break
			}
		}
		time.Sleep(200 * time.Microsecond)
		holding.Add(-1)
	}
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() {
			var s seat.Seat
			if err := g.Take(t.Context(), &s); err != nil {
				t.Error(err)
				return
			}
			defer s.Leave()
			for range 3 {
				hold()
				s.Away()
				time.Sleep(100 * time.Microsecond) // a store round trip, off the seat
				if err := s.Back(t.Context()); err != nil {
					t.Error(err)
					return
				}
			}
			hold()
		})
	}
	wg.Wait()
	if m := most.Load(); m != 3 {
		t.Fatalf("at most %d goroutines held a seat at once; want exactly the gate's 3", m)
	}
}

func TestAwayFreesASeat(t *testing.T) {
	g := seat.NewGate(1)
	var a, b seat.Seat
	if err := g.Take(t.Context(), &a); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	if err := g.Take(ctx, &b); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Take on a full gate = %v, want the context's deadline", err)
	}
	a.Away()
	a.Away() // idempotent: must not free a second seat
	if err := g.Take(t.Context(), &b); err != nil {
		t.Fatalf("Take after Away = %v", err)
	}
	ctx2, cancel2 := context.WithCancelCause(t.Context())
	why := errors.New("stopping")
	cancel2(why)
	if err := a.Back(ctx2); !errors.Is(err, why) {
		t.Fatalf("Back on a full gate with an ended context = %v, want its cause", err)
	}
	b.Leave()
	b.Leave() // idempotent
	if err := a.Back(t.Context()); err != nil {
		t.Fatalf("Back after Leave = %v", err)
	}
	if err := a.Back(t.Context()); err != nil { // held: nothing to do
		t.Fatalf("Back while held = %v", err)
	}
	var c seat.Seat
	ctx3, cancel3 := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel3()
	if err := g.Take(ctx3, &c); err == nil {
		t.Fatal("a second Back took a second seat of a gate of 1")
	}
}

func TestNilSeatAndContext(t *testing.T) {
	var s *seat.Seat
	s.Away()
	s.Leave()
	if err := s.Back(t.Context()); err != nil {
		t.Fatalf("nil seat Back = %v", err)
	}
	if got := seat.From(t.Context()); got != nil {
		t.Fatalf("From without a seat = %p, want nil", got)
	}
	var own seat.Seat
	if got := seat.From(seat.With(t.Context(), &own)); got != &own {
		t.Fatalf("From = %p, want %p", got, &own)
	}
}

// seatsFree reports whether all n seats of g can be taken at once (and
// gives them back): nothing leaked.
func seatsFree(t *testing.T, g *seat.Gate, n int) bool {
	t.Helper()
	ss := make([]seat.Seat, n)
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	ok := true
	for i := range ss {
		if g.Take(ctx, &ss[i]) != nil {
			ok = false
			break
		}
	}
	for i := range ss {
		ss[i].Leave()
	}
	return ok
}

// Goroutines sharing one seat and calling Away, Back and Leave in any
// order never leak a seat nor give one back twice.
func TestSeatConcurrentUse(t *testing.T) {
	const size = 3
	g := seat.NewGate(size)
	for range 50 {
		var s seat.Seat
		if err := g.Take(t.Context(), &s); err != nil {
			t.Fatal(err)
		}
		// A leak would leave Back waiting for a seat forever: bounded.
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		var wg sync.WaitGroup
		for i := range 8 {
			wg.Go(func() {
				for j := range 20 {
					if (i+j)%2 == 0 {
						s.Away()
					} else if err := s.Back(ctx); err != nil && !errors.Is(err, seat.ErrStopped) {
						t.Error(err)
					}
				}
			})
		}
		wg.Go(func() { time.Sleep(50 * time.Microsecond); s.Leave() })
		wg.Wait()
		cancel()
		if t.Failed() {
			return
		}
		s.Leave()
		if err := s.Back(t.Context()); !errors.Is(err, seat.ErrStopped) {
			t.Fatalf("Back after Leave = %v, want ErrStopped", err)
		}
	}
	if !seatsFree(t, g, size) {
		t.Fatal("a seat leaked")
	}
	if seatsFree(t, g, size+1) {
		t.Fatal("a gate of 3 gave a 4th seat: one was given back twice")
	}
}

// Stop makes waiting and later Backs return ErrStopped; held seats stay
// held; Take is not affected.
func TestGateStop(t *testing.T) {
	g := seat.NewGate(1)
	var a, b seat.Seat
	if err := g.Take(t.Context(), &a); err != nil {
		t.Fatal(err)
	}
	a.Away()
	if err := g.Take(t.Context(), &b); err != nil {
		t.Fatal(err)
	}
	back := make(chan error, 1)
	go func() { back <- a.Back(t.Context()) }()
	time.Sleep(10 * time.Millisecond) // let it wait; it cannot have a seat
	g.Stop()
	g.Stop() // idempotent
	if err := <-back; !errors.Is(err, seat.ErrStopped) {
		t.Fatalf("waiting Back after Stop = %v, want ErrStopped", err)
	}
	var c seat.Seat
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	if g.Take(ctx, &c) == nil {
		t.Fatal("Stop gave b's held seat away")
	}
	b.Leave()
	if err := a.Back(t.Context()); !errors.Is(err, seat.ErrStopped) {
		t.Fatalf("Back on a free seat after Stop = %v, want ErrStopped", err)
	}
	if err := g.Take(t.Context(), &c); err != nil {
		t.Fatalf("Take after Stop = %v; the adapter decides, not the gate", err)
	}
	c.Leave()
	var nilGate *seat.Gate
	nilGate.Stop()
}

// A Back whose context has ended takes no seat, even a free one.
func TestBackWithEndedContext(t *testing.T) {
	g := seat.NewGate(1)
	var a seat.Seat
	if err := g.Take(t.Context(), &a); err != nil {
		t.Fatal(err)
	}
	a.Away()
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := a.Back(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Back with an ended context = %v, want Canceled", err)
	}
	if !seatsFree(t, g, 1) {
		t.Fatal("Back with an ended context took the seat")
	}
}
