// Package leasekeep is the lease flow of the idem middleware that claim
// through a dedup.LeaseStore, written once: Run (used by consumer.Dedup and
// the Watermill middleware) holds a claimed key from the claim to
// Complete or Release, with the handler's context and a heartbeat that keeps
// the lease while the handler runs.
//
// The parts are built to make the common case free. Most handlers return
// long before their lease needs extending, so a per-message timer, armed and
// stopped again, was most of what a heartbeat cost. Here one timer per
// middleware (a Keeper) serves every handler in flight: starting and
// stopping a Hold links and unlinks a list node under a mutex, with no
// allocation, no timer and no clock read. Likewise Complete and Release on an
// in-process store return at once, so the context that bounds them (Finish)
// reads the clock only when asked and arms a timer only when someone waits
// on Done.
package leasekeep

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem/dedup"
)

// Keeper extends the leases of the handlers in flight of one middleware. It
// holds one timer per beat interval and runs it only while some Hold is
// linked. The zero value is not usable: use New.
type Keeper struct {
	store  dedup.LeaseStore
	logger *slog.Logger
	prefix string // names the middleware in errors: "consumer", "watermill"

	last atomic.Pointer[ticker] // the ticker used last: the fast path
	mu   sync.Mutex
	all  map[time.Duration]*ticker
}

// New returns a Keeper that extends leases of store, logging failed beats to
// logger. prefix starts the lease-lost error, for example "consumer".
func New(store dedup.LeaseStore, logger *slog.Logger, prefix string) *Keeper {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Keeper{store: store, logger: logger, prefix: prefix, all: map[time.Duration]*ticker{}}
}

// ticker serves the Holds that beat every `every`. It ticks every every/2
// while at least one is linked. A Hold is marked at the first tick after it
// was linked and extended at the next one, so its first beat comes between
// every/2 and every after the claim, and later beats every `every` (plus the
// time an Extend takes).
type ticker struct {
	k       *Keeper
	every   time.Duration
	mu      sync.Mutex
	head    *Hold
	ticking bool
	timer   *time.Timer
}

func (k *Keeper) ticker(every time.Duration) *ticker {
	if t := k.last.Load(); t != nil && t.every == every {
		return t
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	t, ok := k.all[every]
	if !ok {
		t = &ticker{k: k, every: every}
		k.all[every] = t
	}
	k.last.Store(t)
	return t
}

// Hold is one handler's lease while it runs. Embed it in a per-message
// struct: it needs no allocation of its own. A Hold is used once: Start, then
// Stop.
type Hold struct {
	t       *ticker
	lease   *dedup.Lease
	ctx     context.Context // the message's: values and logs
	timeout time.Duration   // bound of one Extend
	onLost  Canceler

	// Guarded by t.mu.
	prev, next *Hold
	linked     bool
	seen       bool // a tick saw it; the next one beats
	beating    bool
	stopped    bool
	cancel     context.CancelFunc // cancels an Extend in progress
	lost       error

	beats sync.WaitGroup
}

// Canceler is told that a lease was lost. An interface, not a func: a
// method value of the per-message struct that holds the handler's context
// would cost an allocation per message.
type Canceler interface {
	Cancel(cause error)
}

// CancelFunc adapts a function, such as a context.CancelCauseFunc, to
// Canceler.
type CancelFunc func(cause error)

// Cancel calls f.
func (f CancelFunc) Cancel(cause error) { f(cause) }

// Start begins extending lease every `every` until Stop. every ≤ 0 disables
// the beats (Stop then returns nil at once). ctx is the message's context:
// beats run with its values but not its cancellation, so a handler that
// finishes its work while the consumer stops keeps its lease. When the
// store answers dedup.ErrLeaseLost, onLost.Cancel is called once, with an
// error wrapping it, and the beats end. onLost is usually the handler's
// HandlerCtx; CancelFunc adapts a function.
func (k *Keeper) Start(ctx context.Context, h *Hold, lease *dedup.Lease, every time.Duration, onLost Canceler) {
	if every <= 0 {
		h.stopped = true
		return
	}
	h.lease, h.ctx, h.onLost = lease, ctx, onLost
	// Each Extend may take up to the lease's TTL: past that the lease is
	// gone anyway.
	h.timeout = lease.TTL
	if h.timeout <= 0 {
		h.timeout = every
	}
	t := k.ticker(every)
	h.t = t
	t.mu.Lock()
	h.next = t.head
	if t.head != nil {
		t.head.prev = h
	}
	t.head = h
	h.linked = true
	if !t.ticking {
		t.ticking = true
		if t.timer == nil {
			t.timer = time.AfterFunc(t.every/2, t.tick)
		} else {
			t.timer.Reset(t.every / 2)
		}
	}
	t.mu.Unlock()
}

// Stop ends the beats, cancels an Extend in progress and waits for it. It
// returns the lease-lost error a beat saw, or nil. It is safe to call more
// than once.
func (h *Hold) Stop() error {
	t := h.t
	if t == nil {
		return nil
	}
	t.mu.Lock()
	h.stopped = true
	t.unlinkLocked(h)
	cancel, beating, lost := h.cancel, h.beating, h.lost
	t.mu.Unlock()
	if cancel != nil {
		cancel()
	}
	h.beats.Wait()
	if !beating {
		// No beat was under way, and unlinked, the Hold gets no other:
		// lost is final.
		return lost
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return h.lost
}

func (t *ticker) unlinkLocked(h *Hold) {
	if !h.linked {
		return
	}
	if h.prev != nil {
		h.prev.next = h.next
	} else {
		t.head = h.next
	}
	if h.next != nil {
		h.next.prev = h.prev
	}
	h.prev, h.next, h.linked = nil, nil, false
}

// tick is the timer's function: it marks the Holds it has not seen and
// starts a beat for those it saw at the previous tick.
func (t *ticker) tick() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.head == nil {
		t.ticking = false
		return
	}
	for h := t.head; h != nil; h = h.next {
		if h.beating {
			continue
		}
		if !h.seen {
			h.seen = true
			continue
		}
		h.seen = false
		h.beating = true
		h.beats.Add(1)
		ctx, cancel := context.WithTimeout(context.WithoutCancel(h.ctx), h.timeout)
		h.cancel = cancel
		go t.beat(ctx, h)
	}
	t.timer.Reset(t.every / 2)
}

func (t *ticker) beat(ctx context.Context, h *Hold) {
	defer h.beats.Done()
	err := t.k.store.Extend(ctx, h.lease)
	t.mu.Lock()
	h.cancel()
	h.cancel = nil
	h.beating = false
	stopped := h.stopped
	var lost error
	if errors.Is(err, dedup.ErrLeaseLost) {
		lost = fmt.Errorf("%s: heartbeat: %w", t.k.prefix, err)
		h.lost = lost
		t.unlinkLocked(h)
	}
	t.mu.Unlock()
	switch {
	case err == nil:
	case lost != nil:
		t.k.logger.WarnContext(h.ctx, "idem: lease lost while the handler ran; cancelling it",
			slog.String("key_hash", h.lease.Key.Hash()), slog.Any("error", err))
		h.onLost.Cancel(lost)
	case stopped:
		// The handler returned; Stop cancelled the Extend.
	default:
		t.k.logger.WarnContext(h.ctx, "idem: extending the lease failed; trying again at the next beat",
			slog.String("key_hash", h.lease.Key.Hash()), slog.Any("error", err))
	}
}

// Finish is the context Complete and Release run under: the message
// context's values without its cancellation (context.WithoutCancel), done
// after a timeout. It does what context.WithTimeout(context.WithoutCancel(
// ctx), timeout) does, without the timer and allocations when nobody waits:
// the deadline is fixed at the first call of Deadline, Done or Err, and a
// timer is armed only by Done. Embed it in a per-message struct, Init it,
// pass a pointer as the context, and Close it when the call returned.
type Finish struct {
	parent  context.Context // without cancellation
	timeout time.Duration

	mu       sync.Mutex
	started  bool
	deadline time.Time
	done     chan struct{}
	timer    *time.Timer
	err      error
}

var _ context.Context = (*Finish)(nil)

// Init prepares f for a call bounded by timeout, with ctx's values. It
// starts afresh, so a Finish may be used for another call after Close —
// once nothing holds the previous call's context any more (Init overwrites
// its state, mutex included).
func (f *Finish) Init(ctx context.Context, timeout time.Duration) {
	*f = Finish{parent: context.WithoutCancel(ctx), timeout: timeout}
}

// startLocked fixes the deadline at the first use and reports whether it has
// passed. f.mu is held.
func (f *Finish) startLocked() {
	now := time.Now()
	if !f.started {
		f.started = true
		f.deadline = now.Add(f.timeout)
	}
	if f.err == nil && !now.Before(f.deadline) {
		f.expireLocked()
	}
}

func (f *Finish) expireLocked() {
	if f.err != nil {
		return
	}
	f.err = context.DeadlineExceeded
	if f.done != nil {
		close(f.done)
	}
}

func (f *Finish) expire() {
	f.mu.Lock()
	f.expireLocked()
	f.mu.Unlock()
}

// Deadline implements context.Context.
func (f *Finish) Deadline() (time.Time, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.startLocked()
	return f.deadline, true
}

// Done implements context.Context. The first call arms the timer.
func (f *Finish) Done() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.done == nil {
		f.done = make(chan struct{})
		f.startLocked()
		if f.err != nil {
			close(f.done)
		} else {
			f.timer = time.AfterFunc(time.Until(f.deadline), f.expire)
		}
	}
	return f.done
}

// Err implements context.Context.
func (f *Finish) Err() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.startLocked()
	return f.err
}

// Value implements context.Context.
func (f *Finish) Value(key any) any { return f.parent.Value(key) }

func (f *Finish) String() string { return "idem finish context" }

// Close stops the timer, if Done armed one. The context stays usable (its
// values) but is done from then on with context.Canceled, like a
// context.WithTimeout after its cancel function ran.
func (f *Finish) Close() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.timer != nil {
		f.timer.Stop()
	}
	if f.err == nil {
		f.err = context.Canceled
		if f.done != nil {
			close(f.done)
		}
	}
}
