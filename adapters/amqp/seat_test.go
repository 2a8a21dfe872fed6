package idemamqp

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

// TestGateBoundsHolders runs 64 goroutines that each take a seat of a gate
// of 3, give it up and take it back a few times, and steps them one hold at
// a time: whenever every goroutine is blocked, exactly min(3, goroutines
// left) hold a seat, never more, and none waits for a seat while one is
// free.
func TestGateBoundsHolders(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const size, n = 3, 64
		g := newGate(size)
		var holding, left atomic.Int64
		step := make(chan struct{})
		hold := func() {
			holding.Add(1)
			<-step
			holding.Add(-1)
		}
		left.Store(n)
		for range n {
			go func() {
				defer left.Add(-1)
				var s seat
				if err := g.take(t.Context(), &s); err != nil {
					t.Error(err)
					return
				}
				defer s.leave()
				for range 3 {
					hold()
					s.Away() // a store round trip, off the seat
					if err := s.Back(t.Context()); err != nil {
						t.Error(err)
						return
					}
				}
				hold()
			}()
		}
		for {
			synctest.Wait()
			l, h := left.Load(), holding.Load()
			if want := min(size, l); h != want {
				t.Fatalf("%d goroutines hold a seat with %d left; want %d", h, l, want)
			}
			if l == 0 {
				return
			}
			step <- struct{}{}
		}
	})
}

func TestAwayFreesASeat(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		g := newGate(1)
		var a, b seat
		if err := g.take(t.Context(), &a); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
		defer cancel()
		if err := g.take(ctx, &b); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("take on a full gate = %v, want the context's deadline", err)
		}
		a.Away()
		a.Away() // idempotent: must not free a second seat
		if err := g.take(t.Context(), &b); err != nil {
			t.Fatalf("take after Away = %v", err)
		}
		ctx2, cancel2 := context.WithCancelCause(t.Context())
		why := errors.New("stopping")
		cancel2(why)
		if err := a.Back(ctx2); !errors.Is(err, why) {
			t.Fatalf("Back on a full gate with an ended context = %v, want its cause", err)
		}
		b.leave()
		b.leave() // idempotent
		if err := a.Back(t.Context()); err != nil {
			t.Fatalf("Back after leave = %v", err)
		}
		if err := a.Back(t.Context()); err != nil { // held: nothing to do
			t.Fatalf("Back while held = %v", err)
		}
		var c seat
		ctx3, cancel3 := context.WithTimeout(t.Context(), 20*time.Millisecond)
		defer cancel3()
		if err := g.take(ctx3, &c); err == nil {
			t.Fatal("a second Back took a second seat of a gate of 1")
		}
		a.leave()
	})
}

func TestNilSeat(t *testing.T) {
	t.Parallel()
	var s *seat
	s.Away()
	s.leave()
	if err := s.Back(t.Context()); err != nil {
		t.Fatalf("nil seat Back = %v", err)
	}
	var g *gate
	g.stop()
}

// seatsFree reports whether all n seats of g can be taken at once (and
// gives them back): nothing leaked.
func seatsFree(t *testing.T, g *gate, n int) bool {
	t.Helper()
	ss := make([]seat, n)
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	ok := true
	for i := range ss {
		if g.take(ctx, &ss[i]) != nil {
			ok = false
			break
		}
	}
	for i := range ss {
		ss[i].leave()
	}
	return ok
}

// Goroutines sharing one seat and calling Away, Back and leave in any
// order never leak a seat nor give one back twice.
func TestSeatConcurrentUse(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const size = 3
		g := newGate(size)
		for range 50 {
			var s seat
			if err := g.take(t.Context(), &s); err != nil {
				t.Fatal(err)
			}
			// A leak would leave Back waiting for a seat forever: bounded.
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			var wg sync.WaitGroup
			var once sync.Once
			midway := make(chan struct{}) // a goroutine is half-way through
			for i := range 8 {
				wg.Go(func() {
					for j := range 20 {
						if j == 10 {
							once.Do(func() { close(midway) })
						}
						if (i+j)%2 == 0 {
							s.Away()
						} else if err := s.Back(ctx); err != nil && !errors.Is(err, errStopped) {
							t.Error(err)
						}
					}
				})
			}
			wg.Go(func() { <-midway; s.leave() })
			wg.Wait()
			cancel()
			if t.Failed() {
				return
			}
			s.leave()
			if err := s.Back(t.Context()); !errors.Is(err, errStopped) {
				t.Fatalf("Back after leave = %v, want errStopped", err)
			}
		}
		if !seatsFree(t, g, size) {
			t.Fatal("a seat leaked")
		}
		if seatsFree(t, g, size+1) {
			t.Fatal("a gate of 3 gave a 4th seat: one was given back twice")
		}
	})
}

// stop makes waiting and later Backs return errStopped; held seats stay
// held; take is not affected.
func TestGateStop(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		g := newGate(1)
		var a, b seat
		if err := g.take(t.Context(), &a); err != nil {
			t.Fatal(err)
		}
		a.Away()
		if err := g.take(t.Context(), &b); err != nil {
			t.Fatal(err)
		}
		back := make(chan error, 1)
		go func() { back <- a.Back(t.Context()) }()
		synctest.Wait() // Back waits: b holds the only seat
		select {
		case err := <-back:
			t.Fatalf("Back on a full gate returned %v before stop", err)
		default:
		}
		g.stop()
		g.stop() // idempotent
		if err := <-back; !errors.Is(err, errStopped) {
			t.Fatalf("waiting Back after stop = %v, want errStopped", err)
		}
		var c seat
		ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
		defer cancel()
		if g.take(ctx, &c) == nil {
			t.Fatal("stop gave b's held seat away")
		}
		b.leave()
		if err := a.Back(t.Context()); !errors.Is(err, errStopped) {
			t.Fatalf("Back on a free seat after stop = %v, want errStopped", err)
		}
		if err := g.take(t.Context(), &c); err != nil {
			t.Fatalf("take after stop = %v; the consumer decides, not the gate", err)
		}
		c.leave()
	})
}

// A Back whose context has ended takes no seat, even a free one.
func TestBackWithEndedContext(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		g := newGate(1)
		var a seat
		if err := g.take(t.Context(), &a); err != nil {
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
	})
}

// noDone is a context whose Done channel must not be asked for.
type noDone struct {
	context.Context
	asked atomic.Bool
}

func (c *noDone) Done() <-chan struct{} {
	c.asked.Store(true)
	return c.Context.Done()
}

// Back takes a free seat without asking its context for a Done channel:
// the handler context of consumer.Dedup makes one (a cancel context
// registered with its parent) only when asked.
func TestBackOnAFreeSeatLeavesDoneAlone(t *testing.T) {
	t.Parallel()
	g := newGate(1)
	var s seat
	if err := g.take(t.Context(), &s); err != nil {
		t.Fatal(err)
	}
	s.Away()
	ctx := &noDone{Context: t.Context()}
	if err := s.Back(ctx); err != nil {
		t.Fatalf("Back on a free seat = %v", err)
	}
	if ctx.asked.Load() {
		t.Fatal("Back asked for the context's Done channel although a seat was free")
	}
	var other seat
	full, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	if err := g.take(full, &other); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("take on a full gate = %v, want the context's deadline: Back did not take the seat", err)
	}
	s.leave()
}
