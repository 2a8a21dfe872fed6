package leasekeep

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

type hctxKey struct{}

var errCause = errors.New("the cause")

// isDone reports whether ch is closed, without waiting.
func isDone(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// TestHandlerCtxAnswersLikeWithCancelCause compares HandlerCtx with the
// context.WithCancelCause it stands for, through every order of the things
// that can happen to it: the parent cancelled or not, Done asked for before
// the cancel, after it, or never.
func TestHandlerCtxAnswersLikeWithCancelCause(t *testing.T) {
	parentCause := errors.New("the parent's cause")
	// The parent is cancelled never, before or after the handler's
	// context.
	for _, parentCancelled := range []string{"parent live", "parent cancelled first", "parent cancelled after"} {
		for _, doneFirst := range []bool{false, true} {
			for _, cancelled := range []bool{false, true} {
				name := parentCancelled +
					map[bool]string{false: "", true: "/Done first"}[doneFirst] +
					map[bool]string{false: "", true: "/cancelled"}[cancelled]
				t.Run(name, func(t *testing.T) {
					parent, cancelParent := context.WithCancelCause(context.WithValue(context.Background(), hctxKey{}, "v"))
					defer cancelParent(nil)
					want, cancelWant := context.WithCancelCause(parent)
					defer cancelWant(nil)
					got := &HandlerCtx{parent: parent}
					if doneFirst {
						_, _ = got.Done(), want.Done()
					}
					if parentCancelled == "parent cancelled first" {
						cancelParent(parentCause)
					}
					if cancelled {
						got.Cancel(errCause)
						cancelWant(errCause)
						// The first cause wins.
						got.Cancel(nil)
						cancelWant(nil)
					}
					if parentCancelled == "parent cancelled after" {
						cancelParent(parentCause)
					}
					if g, w := got.Err(), want.Err(); g != w {
						t.Errorf("Err = %v, want %v", g, w)
					}
					if g, w := context.Cause(got), context.Cause(want); g != w {
						t.Errorf("Cause = %v, want %v", g, w)
					}
					if g := got.Value(hctxKey{}); g != "v" {
						t.Errorf("Value = %v", g)
					}
					if g, w := isDone(got.Done()), isDone(want.Done()); g != w {
						t.Errorf("Done closed %v, want %v", g, w)
					}
					if g, w := got.Err(), want.Err(); g != w {
						t.Errorf("Err after Done = %v, want %v", g, w)
					}
				})
			}
		}
	}
}

// TestHandlerCtxLazy: the cancel context is made only by Done or by a use
// after cancel; Err and Value alone make nothing.
func TestHandlerCtxLazy(t *testing.T) {
	c := &HandlerCtx{parent: context.Background()}
	_, _ = c.Err(), c.Value(hctxKey{})
	if c.state.Load() != ctxLazy {
		t.Fatal("Err or Value made the context")
	}
	c.Cancel(errCause)
	if c.state.Load() != ctxPending {
		t.Fatal("cancel made the context")
	}
	if !errors.Is(c.Err(), context.Canceled) || context.Cause(c) != errCause || !isDone(c.Done()) {
		t.Fatalf("after a lazy cancel: Err %v, Cause %v", c.Err(), context.Cause(c))
	}
}

// TestHandlerCtxChildren: a context derived from the handler's is cancelled
// with the handler's cause, whether derived before or after the cancel.
func TestHandlerCtxChildren(t *testing.T) {
	c := &HandlerCtx{parent: context.Background()}
	before, stop := context.WithTimeout(c, time.Hour)
	defer stop()
	c.Cancel(errCause)
	after, stop2 := context.WithCancel(c)
	defer stop2()
	for name, ctx := range map[string]context.Context{"before": before, "after": after} {
		select {
		case <-ctx.Done():
		case <-time.After(10 * time.Second):
			t.Fatalf("child derived %s the cancel is not done", name)
		}
		if context.Cause(ctx) != errCause {
			t.Errorf("child derived %s: Cause %v", name, context.Cause(ctx))
		}
	}
}

// TestHandlerCtxConcurrent runs cancel against readers (go test -race): each
// reader that sees the cancellation sees its cause, and once cancel returned
// every reader sees it.
func TestHandlerCtxConcurrent(t *testing.T) {
	for range 200 {
		c := &HandlerCtx{parent: context.Background()}
		var wg sync.WaitGroup
		for i := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range 20 {
					if i%2 == 0 {
						_ = c.Done()
					}
					if c.Err() != nil && context.Cause(c) != errCause {
						t.Errorf("Cause = %v", context.Cause(c))
						return
					}
				}
			}()
		}
		c.Cancel(errCause)
		if c.Err() == nil || !isDone(c.Done()) {
			t.Fatal("not cancelled after cancel returned")
		}
		wg.Wait()
	}
}
