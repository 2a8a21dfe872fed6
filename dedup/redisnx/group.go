package redisnx

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// errGroupPanic is the error of the callers whose batch panicked in the
// client (a hook); the panic itself goes on in the caller that sent it.
var errGroupPanic = errors.New("redisnx: the Redis call panicked in another caller's batch")

// errUnsent is wrapped in the error of a caller that gave up before its
// items were taken into a batch: they never left the client.
var errUnsent = errors.New("redisnx: not sent")

// maxGroupMembers caps the callers one pipeline carries; the rest wait for
// the next.
const maxGroupMembers = 128

// maxInFlight is how many batches of one group may be in flight at once.
// With one, two callers that meet wait for each other's round trip (and a
// goroutine hand-off): at two concurrent callers half the calls did. With
// two, those callers each send at once; past two, callers queue and share
// pipelines.
const maxInFlight = 2

// group sends the commands of concurrent callers together, as a group
// commit does: a caller that finds fewer than maxInFlight batches in
// flight sends its own at once (no added latency when idle); callers that
// arrive while maxInFlight are in flight queue up, and when one returns the
// first of them sends up to maxGroupMembers of the queued callers' items in
// one pipeline. Under load the round trips per message fall from one per
// call to one per batch, and no caller leads more than one batch.
type group[T any] struct {
	// run sends items and returns an error when Redis could not be
	// reached; errOf then tells each caller's error from its own items
	// (a caller whose commands were answered gets nil).
	run   func(ctx context.Context, items []T) error
	errOf func(items []T, batchErr error) error

	mu       sync.Mutex
	inFlight int // batches sent and not yet returned
	queue    []*member[T]
}

type member[T any] struct {
	ctx     context.Context
	items   []T
	err     error
	done    chan struct{}     // closed when the batch holding items returned
	promote chan []*member[T] // the batch this member must send
}

// do sends items, alone or with other callers', and returns the caller's
// error. A caller alone in its batch sends under its own ctx. A batch of
// several runs under the latest deadline of its callers (none if one has
// none), so one caller giving up does not fail the others; a caller whose
// ctx ends while it waits returns at once, and its items, if already taken
// into a batch, are still sent (a claim so made is never handed out and
// runs out like a crashed worker's lease).
func (g *group[T]) do(ctx context.Context, items []T) error {
	m := &member[T]{ctx: ctx, items: items}
	g.mu.Lock()
	if g.inFlight < maxInFlight {
		g.inFlight++
		g.mu.Unlock()
		g.lead(ctx, []*member[T]{m})
		return m.err
	}
	m.done = make(chan struct{})
	m.promote = make(chan []*member[T], 1)
	g.queue = append(g.queue, m)
	g.mu.Unlock()
	select {
	case <-m.done:
		return m.err
	case batch := <-m.promote:
		g.lead(ctx, batch)
		return m.err
	case <-ctx.Done():
	}
	g.mu.Lock()
	for i, q := range g.queue {
		if q == m { // not taken yet: leave without a trace
			g.queue = append(g.queue[:i], g.queue[i+1:]...)
			g.mu.Unlock()
			return fmt.Errorf("%w (%w)", ctx.Err(), errUnsent)
		}
	}
	g.mu.Unlock()
	// Taken into a batch: if it falls to this caller to send it, someone
	// must, or every caller behind it would wait forever.
	go func() {
		select {
		case <-m.done:
		case batch := <-m.promote:
			g.lead(context.WithoutCancel(ctx), batch)
		}
	}()
	return ctx.Err()
}

// busy reports whether a batch is in flight.
func (g *group[T]) busy() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.inFlight > 0
}

// lead sends batch, hands the results out, then passes the lead to the
// first caller queued meanwhile (or marks the group idle). A panic in run
// (a client hook) still releases every caller and the group before it goes
// on.
func (g *group[T]) lead(ctx context.Context, batch []*member[T]) {
	var items []T
	if len(batch) == 1 {
		items = batch[0].items
	} else {
		var cancel context.CancelFunc
		ctx, cancel = batchContext(ctx, batch)
		defer cancel()
		for _, m := range batch {
			items = append(items, m.items...)
		}
	}
	finished := false
	defer func() {
		if !finished {
			for _, m := range batch {
				m.err = errGroupPanic
				if m.done != nil {
					close(m.done)
				}
			}
			g.handOff()
		}
	}()
	err := g.run(ctx, items)
	for _, m := range batch {
		if err != nil {
			m.err = g.errOf(m.items, err)
		}
		if m.done != nil {
			close(m.done)
		}
	}
	finished = true
	g.handOff()
}

// handOff passes the lead of the batch that returned to the first queued
// caller, with up to maxGroupMembers queued callers as its batch, or
// counts one batch fewer in flight.
func (g *group[T]) handOff() {
	g.mu.Lock()
	n := min(len(g.queue), maxGroupMembers)
	next := g.queue[:n:n]
	g.queue = g.queue[n:]
	if n == 0 {
		g.inFlight--
		g.queue = nil
	}
	g.mu.Unlock()
	if n > 0 {
		next[0].promote <- next
	}
}

// batchContext is the context of a batch of several callers: without the
// leader's cancellation, with the latest deadline of the callers, or none
// when one of them has none.
func batchContext[T any](leader context.Context, batch []*member[T]) (context.Context, context.CancelFunc) {
	var latest time.Time
	for _, m := range batch {
		d, ok := m.ctx.Deadline()
		if !ok {
			return context.WithoutCancel(leader), func() {}
		}
		if d.After(latest) {
			latest = d
		}
	}
	return context.WithDeadline(context.WithoutCancel(leader), latest)
}
