package redisnx

import (
	"context"
	"sync"
)

// group sends the commands of concurrent callers together, as a group
// commit does: a caller that finds no batch in flight sends its own at
// once (no added latency when idle); callers that arrive while one is in
// flight queue up, and when it returns the first of them sends everything
// queued in one pipeline. Under load the round trips per message fall from
// one per call to one per batch, and no caller leads more than one batch.
type group[T any] struct {
	run func(ctx context.Context, items []T) error

	mu    sync.Mutex
	busy  bool
	queue []*member[T]
}

type member[T any] struct {
	items   []T
	err     error
	done    chan struct{}     // closed when the batch holding items returned
	promote chan []*member[T] // the batch this member must send
}

// do sends items, alone or with other callers', and returns the error of
// the round trip (an error about one item stays in that item). ctx bounds
// the call when the caller leads a batch of its own; a batch of several
// callers runs without the leader's cancellation, so one caller giving up
// does not fail the others, and each waits for its batch, which the client's
// own timeouts bound.
func (g *group[T]) do(ctx context.Context, items []T) error {
	m := &member[T]{items: items}
	g.mu.Lock()
	if !g.busy {
		g.busy = true
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
	case batch := <-m.promote:
		g.lead(ctx, batch)
	}
	return m.err
}

// lead sends batch, hands the results out, then passes the lead to the
// first caller queued meanwhile (or marks the group idle).
func (g *group[T]) lead(ctx context.Context, batch []*member[T]) {
	var items []T
	if len(batch) == 1 {
		items = batch[0].items
	} else {
		ctx = context.WithoutCancel(ctx)
		for _, m := range batch {
			items = append(items, m.items...)
		}
	}
	err := g.run(ctx, items)
	for _, m := range batch {
		m.err = err
		if m.done != nil {
			close(m.done)
		}
	}
	g.mu.Lock()
	next := g.queue
	g.queue = nil
	if len(next) == 0 {
		g.busy = false
	}
	g.mu.Unlock()
	if len(next) > 0 {
		next[0].promote <- next
	}
}
