// Package seat bounds how many handlers run at once while letting a
// handler's store round trips run beside them.
//
// An adapter that runs a chain on several deliveries at once (the RabbitMQ
// Consumer) gives each delivery a Seat of a shared Gate and takes it before
// the chain runs. A middleware that waits on a store (consumer.Dedup) gives
// the seat up for the wait with Away and takes one back with Back before it
// calls the handler, the way the Go scheduler hands a thread's P to another
// goroutine during a system call. So at most the gate's size of handlers
// run at once, while more deliveries than that can be in a claim or a
// Complete round trip.
//
// The middleware hides the seat from the handler's context (Hidden), so a
// handler that runs Dedup-wrapped work of its own, in goroutines or not,
// never moves its delivery's seat. A Seat is still safe for concurrent use:
// whatever the calls, a seat is never given back twice nor kept after
// Leave. A nil *Seat (a chain run without a gate) is valid: Away, Back and
// Leave do nothing.
package seat

import (
	"context"
	"errors"
	"sync"
)

// ErrStopped is what Back returns once the gate is stopped: the consumer
// stops, and a delivery that did not start its handler gives way.
var ErrStopped = errors.New("seat: the consumer is stopping; the handler was not started")

// Gate is a set of seats: at most its size are held at once.
type Gate struct {
	seats    chan struct{}
	stopped  chan struct{}
	stopOnce sync.Once
}

// NewGate returns a gate of n seats (n ≥ 1).
func NewGate(n int) *Gate {
	return &Gate{seats: make(chan struct{}, max(n, 1)), stopped: make(chan struct{})}
}

// Stop makes every Back from now on, and every Back waiting, return
// ErrStopped. Seats held stay held until given up. A nil gate ignores it.
func (g *Gate) Stop() {
	if g != nil {
		g.stopOnce.Do(func() { close(g.stopped) })
	}
}

// Seat is one delivery's place at a gate: held or not.
type Seat struct {
	g *Gate

	mu     sync.Mutex
	held   bool
	closed bool // Leave was called: never held again
}

// Take waits for a seat of g and returns it held, or returns ctx's cause
// (and a seat that is not held) when ctx ends first. Take does not look at
// Stop: the adapter decides whether a delivery starts.
func (g *Gate) Take(ctx context.Context, s *Seat) error {
	s.g = g
	select {
	case g.seats <- struct{}{}:
	case <-ctx.Done():
		return context.Cause(ctx)
	}
	s.mu.Lock()
	s.held = true
	s.mu.Unlock()
	return nil
}

// Away gives the seat up while its delivery waits on something other than
// the handler. It does nothing when the seat is not held.
func (s *Seat) Away() {
	if s == nil {
		return
	}
	s.mu.Lock()
	if s.held {
		s.held = false
		<-s.g.seats
	}
	s.mu.Unlock()
}

// Back takes a seat again after Away, waiting for one to be free. It
// returns ctx's cause when ctx ends first, ErrStopped when the gate is
// stopped, and nil at once when the seat is held (or nil). A Back after
// Leave takes nothing and returns ErrStopped.
func (s *Seat) Back(ctx context.Context) error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	held, closed := s.held, s.closed
	s.mu.Unlock()
	switch {
	case held:
		return nil
	case closed:
		return ErrStopped
	}
	if err := ctx.Err(); err != nil {
		return context.Cause(ctx)
	}
	select {
	case <-s.g.stopped:
		return ErrStopped
	default:
	}
	select {
	case s.g.seats <- struct{}{}:
	case <-s.g.stopped:
		return ErrStopped
	case <-ctx.Done():
		return context.Cause(ctx)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held || s.closed {
		// Another goroutine took the seat back meanwhile, or the delivery
		// left: this one is not needed.
		<-s.g.seats
		if s.closed {
			return ErrStopped
		}
	}
	s.held = true
	return nil
}

// Leave gives the seat up for good, when the delivery's chain returned (or
// panicked): later calls of Back take nothing.
func (s *Seat) Leave() {
	if s == nil {
		return
	}
	s.mu.Lock()
	s.closed = true
	if s.held {
		s.held = false
		<-s.g.seats
	}
	s.mu.Unlock()
}

type ctxKey struct{}

// With returns ctx carrying s, for the middleware of s's delivery.
func With(ctx context.Context, s *Seat) context.Context {
	return context.WithValue(ctx, ctxKey{}, s)
}

// From returns the seat ctx carries, or nil.
func From(ctx context.Context) *Seat {
	s, _ := ctx.Value(ctxKey{}).(*Seat)
	return s
}

// Hidden reports whether key is the key under which ctx carries a seat: a
// middleware's own context type answers nil for it (Value), so that the
// handler below does not see the seat.
func Hidden(key any) bool {
	_, ok := key.(ctxKey)
	return ok
}

// Hide returns ctx without its seat, when it carries one.
func Hide(ctx context.Context) context.Context {
	if From(ctx) == nil {
		return ctx
	}
	return context.WithValue(ctx, ctxKey{}, (*Seat)(nil))
}
