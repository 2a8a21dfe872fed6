package idemamqp

import (
	"context"
	"errors"
	"sync"
)

// The handler slots of a Consumer whose InFlight is above its Concurrency:
// each delivery takes a seat of the session's gate before its chain runs,
// and attaches it to its message (consumer.Message.Slot). consumer.Dedup
// gives the seat up for its store round trips (Away) and takes one back
// (Back) before it calls the handler, the way the Go scheduler hands a
// thread's P to another goroutine during a system call. So at most the
// gate's size of handlers run at once, while more deliveries than that can
// be in a claim or a Complete round trip.
//
// A seat is safe for concurrent use: whatever the calls, it is never given
// back twice nor kept after leave. A nil *seat (a chain run without a gate)
// is valid: Away, Back and leave do nothing.

// errStopped is what Back returns once the gate is stopped: the consumer
// stops, and a delivery that did not start its handler gives way.
var errStopped = errors.New("amqp: the consumer is stopping; the handler was not started")

// gate is a set of seats: at most its size are held at once.
type gate struct {
	seats    chan struct{}
	stopped  chan struct{}
	stopOnce sync.Once
}

// newGate returns a gate of n seats (n ≥ 1).
func newGate(n int) *gate {
	return &gate{seats: make(chan struct{}, max(n, 1)), stopped: make(chan struct{})}
}

// stop makes every Back from now on, and every Back waiting, return
// errStopped. Seats held stay held until given up. A nil gate ignores it.
func (g *gate) stop() {
	if g != nil {
		g.stopOnce.Do(func() { close(g.stopped) })
	}
}

// seat is one delivery's place at a gate: held or not.
type seat struct {
	g *gate

	mu     sync.Mutex
	held   bool
	closed bool // leave was called: never held again
}

// take waits for a seat of g and returns it held, or returns ctx's cause
// (and a seat that is not held) when ctx ends first. take does not look at
// stop: the Consumer decides whether a delivery starts.
func (g *gate) take(ctx context.Context, s *seat) error {
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
func (s *seat) Away() {
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
// returns ctx's cause when ctx ends first, errStopped when the gate is
// stopped, and nil at once when the seat is held (or nil). A Back after
// leave takes nothing and returns errStopped.
func (s *seat) Back(ctx context.Context) error {
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
		return errStopped
	}
	if err := ctx.Err(); err != nil {
		return context.Cause(ctx)
	}
	select {
	case <-s.g.stopped:
		return errStopped
	default:
	}
	// A free seat is taken without asking ctx for its Done channel: the
	// handler context consumer.Dedup passes makes one only when asked.
	select {
	case s.g.seats <- struct{}{}:
	default:
		select {
		case s.g.seats <- struct{}{}:
		case <-s.g.stopped:
			return errStopped
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held || s.closed {
		// Another goroutine took the seat back meanwhile, or the delivery
		// left: this one is not needed.
		<-s.g.seats
		if s.closed {
			return errStopped
		}
	}
	s.held = true
	return nil
}

// leave gives the seat up for good, when the delivery's chain returned (or
// panicked): later calls of Back take nothing.
func (s *seat) leave() {
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
