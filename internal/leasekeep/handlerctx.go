package leasekeep

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// HandlerCtx is a handler's context under a lease: the message's context,
// cancelled with the lease-lost error as its cause when a beat finds the
// lease gone (it is the onLost of Keeper.Start), and with context.Canceled
// when the middleware's call ends. It answers like
// context.WithCancelCause(parent), which it replaces because that costs two
// allocations per message while most handlers never wait on their context.
//
// The real context.WithCancelCause is made only when it is needed: at the
// first Done (a handler that waits on its context, derives one from it or
// hands it to a driver), or at the first use after Cancel. Until then Err
// and Value are the parent's — what WithCancelCause's child answers while
// it is not cancelled: its Err is the parent's, and context.Cause, which
// finds the nearest cancel context through Value, sees the parent's cause,
// which is the child's too once the parent is cancelled. A Cancel while
// nothing was made is recorded (the first cause wins, as with
// WithCancelCause) and applied when the context is made, so nobody can
// observe the difference: whoever could wait for the cancellation called
// Done, which made it.
//
// Embed it in a per-message struct, Init it, and use it by pointer.
type HandlerCtx struct {
	parent context.Context
	// state is ctxLazy, ctxPending (cancelled while lazy: cause waits to
	// be applied) or ctxMade (inner and cancelInner are set and never
	// change again). It changes only under mu; reading it needs no lock,
	// and a load that sees ctxMade also sees inner.
	state       atomic.Uint32
	mu          sync.Mutex
	inner       context.Context
	cancelInner context.CancelCauseFunc
	cause       error
}

const (
	ctxLazy uint32 = iota
	ctxPending
	ctxMade
)

var _ context.Context = (*HandlerCtx)(nil)

// Init sets the context c stands for a cancel child of.
func (c *HandlerCtx) Init(parent context.Context) { c.parent = parent }

// made returns the context.WithCancelCause the handler's context stands for,
// making it (and applying a pending cancel) on first use.
func (c *HandlerCtx) made() context.Context {
	if c.state.Load() == ctxMade {
		return c.inner
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state.Load() == ctxMade {
		return c.inner
	}
	switch c.state.Load() {
	case ctxLazy:
		c.inner, c.cancelInner = context.WithCancelCause(c.parent)
	case ctxPending:
		// The cancel came first, so its cause stands even if the parent
		// has been cancelled since: made from the parent, the context
		// would take the parent's cause at once and ignore this one.
		// Once cancelled it never changes, so it needs nothing from the
		// parent but its values (Deadline is the parent's, above).
		c.inner, c.cancelInner = context.WithCancelCause(context.WithoutCancel(c.parent))
		c.cancelInner(c.cause)
	}
	c.state.Store(ctxMade)
	return c.inner
}

// Cancel cancels the context with cause (nil means context.Canceled), as
// the function context.WithCancelCause returns does; only the first call
// counts.
func (c *HandlerCtx) Cancel(cause error) {
	c.mu.Lock()
	switch c.state.Load() {
	case ctxLazy:
		// A parent cancelled first has already cancelled the child it
		// stands for, with its own cause: then this cancel does nothing,
		// and the lazy context keeps answering with the parent's.
		if c.parent.Err() == nil {
			c.cause = cause
			c.state.Store(ctxPending)
		}
		c.mu.Unlock()
		return
	case ctxPending:
		c.mu.Unlock()
		return
	}
	c.mu.Unlock()
	c.cancelInner(cause)
}

// Deadline implements context.Context: cancellation adds none.
func (c *HandlerCtx) Deadline() (time.Time, bool) { return c.parent.Deadline() }

// Done implements context.Context. It makes the cancel context.
func (c *HandlerCtx) Done() <-chan struct{} { return c.made().Done() }

// Err implements context.Context.
func (c *HandlerCtx) Err() error {
	if c.state.Load() == ctxLazy {
		return c.parent.Err()
	}
	return c.made().Err()
}

// Value implements context.Context.
func (c *HandlerCtx) Value(key any) any {
	if c.state.Load() == ctxLazy {
		return c.parent.Value(key)
	}
	return c.made().Value(key)
}

func (c *HandlerCtx) String() string { return "idem handler context" }
