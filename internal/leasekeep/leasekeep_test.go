package leasekeep

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
)

// advance moves a synctest bubble's clock on by d and waits until every
// goroutine of the bubble is blocked again (the beats that came due ran).
func advance(d time.Duration) {
	time.Sleep(d)
	synctest.Wait()
}

func newStore(t *testing.T, lease time.Duration) *memstore.Store {
	t.Helper()
	s, err := memstore.New(memstore.Options{Lease: lease, SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func claim(t *testing.T, s dedup.LeaseStore, id string) *dedup.Lease {
	t.Helper()
	l, err := s.Claim(context.Background(), dedup.Key{Scope: "keep", ID: id})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// The beats keep a lease alive well past its TTL; without them the same
// lease is lost (the control shows the check can fail). The TTL is long
// enough that a scheduling stall under -race on a loaded machine (beats
// come every ttl/3, so a stall of up to about 2/3 s is absorbed) does not
// cost the lease.
func TestHoldKeepsTheLease(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const ttl = time.Second
		s := newStore(t, ttl)
		k := New(s, nil, "test")

		kept := claim(t, s, "kept")
		var h Hold
		k.Start(context.Background(), &h, kept, ttl/3, CancelFunc(func(err error) { t.Errorf("lease lost: %v", err) }))
		control := claim(t, s, "control")

		advance(5 * ttl / 2)
		if err := h.Stop(); err != nil {
			t.Fatalf("Stop: %v", err)
		}
		if err := s.Complete(context.Background(), kept, nil); err != nil {
			t.Fatalf("Complete of the kept lease: %v", err)
		}
		if err := s.Complete(context.Background(), control, nil); !errors.Is(err, dedup.ErrLeaseLost) {
			t.Fatalf("Complete of the lease nobody extended: %v, want ErrLeaseLost", err)
		}
	})
}

// A lease taken over by another owner is reported once through onLost, and
// Stop returns the same error; the beats end.
func TestLostLease(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const ttl = 20 * time.Millisecond
		s := newStore(t, ttl)
		k := New(s, nil, "test")
		l := claim(t, s, "lost")

		var calls atomic.Int32
		got := make(chan error, 1)
		var h Hold
		// Beats far apart: the lease expires before the first one.
		k.Start(context.Background(), &h, l, 8*ttl, CancelFunc(func(err error) {
			calls.Add(1)
			got <- err
		}))
		advance(2 * ttl)
		if _, err := s.Claim(context.Background(), l.Key); err != nil {
			t.Fatalf("a new owner's claim after expiry: %v", err)
		}
		var lost error
		select {
		case lost = <-got:
		case <-time.After(5 * time.Second):
			t.Fatal("onLost was not called")
		}
		if !errors.Is(lost, dedup.ErrLeaseLost) {
			t.Fatalf("onLost got %v, want ErrLeaseLost", lost)
		}
		advance(20 * ttl) // more ticks: no second call
		if err := h.Stop(); err != lost {
			t.Fatalf("Stop returned %v, want %v", err, lost)
		}
		if n := calls.Load(); n != 1 {
			t.Fatalf("onLost called %d times", n)
		}
	})
}

// blockingStore's Extend waits until its context is done.
type blockingStore struct {
	dedup.LeaseStore
	entered chan struct{}
	ended   chan error
}

func (b *blockingStore) Extend(ctx context.Context, _ *dedup.Lease) error {
	b.entered <- struct{}{}
	<-ctx.Done()
	b.ended <- ctx.Err()
	return ctx.Err()
}

// Stop cancels an Extend in progress and waits for it to return.
func TestStopCancelsABeat(t *testing.T) {
	s := newStore(t, time.Minute)
	bs := &blockingStore{LeaseStore: s, entered: make(chan struct{}, 1), ended: make(chan error, 1)}
	k := New(bs, nil, "test")
	l := claim(t, s, "blocked")
	var h Hold
	k.Start(context.Background(), &h, l, 10*time.Millisecond, CancelFunc(func(err error) { t.Errorf("lease lost: %v", err) }))
	select {
	case <-bs.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("no beat started")
	}
	if err := h.Stop(); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	select {
	case err := <-bs.ended:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("the Extend ended with %v, want context.Canceled", err)
		}
	default:
		t.Fatal("Stop returned while the Extend still ran")
	}
}

// losingStore's Extend waits until its context is done, then answers that
// the lease is lost.
type losingStore struct {
	dedup.LeaseStore
	entered chan struct{}
}

func (b *losingStore) Extend(ctx context.Context, l *dedup.Lease) error {
	b.entered <- struct{}{}
	<-ctx.Done()
	return fmt.Errorf("extend %s: %w", l.Key, dedup.ErrLeaseLost)
}

// A beat in progress when Stop is called, which then finds the lease lost,
// decides what Stop returns: the lease-lost error, not the nil seen
// before the beat ended.
func TestStopDuringALosingBeat(t *testing.T) {
	s := newStore(t, time.Minute)
	ls := &losingStore{LeaseStore: s, entered: make(chan struct{}, 1)}
	k := New(ls, nil, "test")
	l := claim(t, s, "losing")
	var h Hold
	k.Start(context.Background(), &h, l, 10*time.Millisecond, CancelFunc(func(error) {}))
	select {
	case <-ls.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("no beat started")
	}
	if err := h.Stop(); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("Stop returned %v, want an error wrapping ErrLeaseLost", err)
	}
	if err := h.Stop(); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("a second Stop returned %v, want an error wrapping ErrLeaseLost", err)
	}
}

// The message context's cancellation does not stop the beats: a handler
// that finishes during a graceful stop keeps its lease.
func TestBeatsOutliveTheMessageContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const ttl = time.Second
		s := newStore(t, ttl)
		k := New(s, nil, "test")
		l := claim(t, s, "cancelled")
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		var h Hold
		k.Start(ctx, &h, l, ttl/3, CancelFunc(func(err error) { t.Errorf("lease lost: %v", err) }))
		advance(2 * ttl) // past the TTL: only beats keep the lease
		if err := h.Stop(); err != nil {
			t.Fatal(err)
		}
		if err := s.Complete(context.Background(), l, nil); err != nil {
			t.Fatalf("Complete: %v", err)
		}
	})
}

// Many holds starting and stopping at once, with beats running among them:
// every lease survives and, once all stopped, the timer stops ticking. The
// holds run 0, 1/2, 1 and 3/2 TTLs: the longest ones need beats.
func TestManyHolds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const ttl = time.Second
		s := newStore(t, ttl)
		k := New(s, nil, "test")
		var wg sync.WaitGroup
		var failed atomic.Int32
		for i := range 200 {
			wg.Go(func() {
				l, err := s.Claim(context.Background(), dedup.Key{Scope: "many", ID: strconv.Itoa(i)})
				if err != nil {
					failed.Add(1)
					return
				}
				var h Hold
				k.Start(context.Background(), &h, l, ttl/3, CancelFunc(func(error) { failed.Add(1) }))
				time.Sleep(time.Duration(i%4) * ttl / 2) // in the bubble: the fake clock
				if h.Stop() != nil || s.Complete(context.Background(), l, nil) != nil {
					failed.Add(1)
				}
			})
		}
		wg.Wait()
		if n := failed.Load(); n != 0 {
			t.Fatalf("%d of 200 holds lost their lease", n)
		}
		tk := k.ticker(ttl / 3)
		deadline := time.Now().Add(5 * time.Second)
		for {
			tk.mu.Lock()
			ticking, head := tk.ticking, tk.head
			tk.mu.Unlock()
			if head != nil {
				t.Fatal("a stopped hold is still linked")
			}
			if !ticking {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the timer still ticks with no hold linked")
			}
			advance(ttl / 6)
		}
	})
}

// every ≤ 0: no beats, Stop is a no-op.
func TestNoBeats(t *testing.T) {
	s := newStore(t, time.Minute)
	k := New(s, nil, "test")
	var h Hold
	k.Start(context.Background(), &h, claim(t, s, "none"), 0, nil)
	if err := h.Stop(); err != nil {
		t.Fatal(err)
	}
	if len(k.all) != 0 {
		t.Fatal("a ticker was made for a hold without beats")
	}
}

type ctxKey struct{}

// A Finish ignores its parent's cancellation and cause until its own
// deadline, then is done with DeadlineExceeded. The checks before the
// deadline use a Finish whose deadline is an hour away, so that no stall of
// the test goroutine can make them race the deadline; the checks at the
// deadline use one with a short timeout and wait on Done.
func TestFinishDeadline(t *testing.T) {
	parent, cancel := context.WithCancelCause(context.WithValue(context.Background(), ctxKey{}, "v"))
	cancel(errors.New("the consumer stopped"))

	var before Finish
	before.Init(parent, time.Hour)
	defer before.Close()
	if before.Value(ctxKey{}) != "v" {
		t.Fatal("the parent's value is lost")
	}
	if err := before.Err(); err != nil {
		t.Fatalf("Err before the deadline: %v (the parent's cancellation leaked in)", err)
	}
	if c := context.Cause(&before); c != nil {
		t.Fatalf("Cause before the deadline: %v", c)
	}
	if dl, ok := before.Deadline(); !ok || time.Until(dl) > time.Hour || time.Until(dl) < 0 {
		t.Fatalf("Deadline %v, %v", dl, ok)
	}
	select {
	case <-before.Done():
		t.Fatal("Done closed before the deadline (the parent's cancellation leaked in)")
	default:
	}

	var f Finish
	f.Init(parent, 50*time.Millisecond)
	defer f.Close()
	dl, ok := f.Deadline()
	if !ok || time.Until(dl) > 50*time.Millisecond {
		t.Fatalf("Deadline %v, %v", dl, ok)
	}
	child, ccancel := context.WithCancel(&f)
	defer ccancel()
	select {
	case <-f.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("Done not closed at the deadline")
	}
	if !errors.Is(f.Err(), context.DeadlineExceeded) {
		t.Fatalf("Err after the deadline: %v", f.Err())
	}
	if c := context.Cause(&f); !errors.Is(c, context.DeadlineExceeded) {
		t.Fatalf("Cause after the deadline: %v (the parent's cause leaked in)", c)
	}
	select {
	case <-child.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("a derived context was not cancelled at the deadline")
	}
	if time.Now().Before(dl) {
		t.Fatal("done before its deadline")
	}
}

// Err alone (no Done, no timer) still sees the deadline.
func TestFinishErrWithoutDone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var f Finish
		f.Init(context.Background(), 20*time.Millisecond)
		defer f.Close()
		if err := f.Err(); err != nil {
			t.Fatal(err)
		}
		advance(40 * time.Millisecond)
		if !errors.Is(f.Err(), context.DeadlineExceeded) {
			t.Fatalf("Err past the deadline: %v", f.Err())
		}
		select {
		case <-f.Done():
		default:
			t.Fatal("Done open while Err reports the deadline")
		}
	})
}

func TestFinishClose(t *testing.T) {
	var f Finish
	f.Init(context.Background(), time.Hour)
	done := f.Done()
	f.Close()
	select {
	case <-done:
	default:
		t.Fatal("Done open after Close")
	}
	if !errors.Is(f.Err(), context.Canceled) {
		t.Fatalf("Err after Close: %v", f.Err())
	}
	if f.timer.Stop() {
		t.Fatal("the timer still ran after Close")
	}
}

// A Finish used again after Close starts afresh: not done, a new deadline.
func TestFinishReuse(t *testing.T) {
	var f Finish
	f.Init(context.Background(), time.Hour)
	_ = f.Done()
	f.Close()
	if !errors.Is(f.Err(), context.Canceled) {
		t.Fatalf("Err after Close = %v, want Canceled", f.Err())
	}
	f.Init(context.Background(), time.Minute)
	if err := f.Err(); err != nil {
		t.Fatalf("Err after a second Init = %v, want nil", err)
	}
	select {
	case <-f.Done():
		t.Fatal("Done is closed after a second Init")
	default:
	}
	if d, _ := f.Deadline(); time.Until(d) > time.Minute {
		t.Fatalf("deadline %v away, want at most the second Init's minute", time.Until(d))
	}
	f.Close()
}
