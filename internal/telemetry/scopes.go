package telemetry

import (
	"sync"
	"sync/atomic"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// MaxScopes bounds the scopes that get their own claim instruments: a scope
// function that returns unbounded values (a path with ids in it) folds into
// OverflowScope past it, instead of growing memory and time series forever.
const MaxScopes = 1024

// OverflowScope is the idem.scope of the scopes past MaxScopes.
const OverflowScope = "_other"

// Scopes holds the claim instruments (Dedup) of each scope a middleware
// sees, for middleware whose scope varies per message (a Watermill
// handler name, an HTTP route). Lookups are lock-free on an immutable map;
// a new scope copies it.
type Scopes struct {
	mp    metric.MeterProvider
	tp    trace.TracerProvider
	store string
	mu    sync.Mutex
	m     atomic.Pointer[map[string]*Dedup]
}

// NewScopes returns the per-scope instruments of one store on mp and tp
// (nil: the globals).
func NewScopes(mp metric.MeterProvider, tp trace.TracerProvider, store string) *Scopes {
	return &Scopes{mp: mp, tp: tp, store: store}
}

// Get returns the instruments of scope, creating them on first use.
func (s *Scopes) Get(scope string) *Dedup {
	if m := s.m.Load(); m != nil {
		if d, ok := (*m)[scope]; ok {
			return d
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var old map[string]*Dedup
	if m := s.m.Load(); m != nil {
		old = *m
	}
	if d, ok := old[scope]; ok {
		return d
	}
	name := scope
	if len(old) >= MaxScopes {
		if d, ok := old[OverflowScope]; ok {
			return d
		}
		name = OverflowScope
	}
	d := NewDedup(s.mp, s.tp, name, s.store)
	m := make(map[string]*Dedup, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	m[name] = d
	s.m.Store(&m)
	return d
}
