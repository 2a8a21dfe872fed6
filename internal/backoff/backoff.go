// Package backoff holds the delays and waits of idem's retry loops: the
// consumer's Retry middleware, the adapters' reconnects and retries, the
// outbox relays and the HTTP client. Written once, so that every loop
// grows, caps, spreads and waits alike.
package backoff

import (
	"context"
	"math"
	"math/rand/v2"
	"time"
)

// Pow is the delay before retry n (1-based) of a geometric backoff:
// base·factor^(n-1), at most limit; base (capped by limit) for n < 2 or a
// factor at or below 1. It never overflows.
func Pow(base, limit time.Duration, factor float64, n int) time.Duration {
	if n < 2 || factor <= 1 || base <= 0 {
		return min(base, limit)
	}
	d := float64(base) * math.Pow(factor, float64(n-1))
	if d >= float64(limit) || math.IsNaN(d) {
		return limit
	}
	return time.Duration(d)
}

// Spread returns d spread uniformly by ±20%, so that clients that failed
// together do not retry together.
func Spread(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}

// Full returns a uniformly random delay in [0, d] ("full jitter"); 0 for
// d ≤ 0.
func Full(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return rand.N(d + 1)
}

// Upper returns a uniformly random delay in [d/2, d]; 0 for d ≤ 0.
func Upper(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return d/2 + rand.N(d/2+1)
}

// Growing is an exponential delay for a loop that retries until it
// succeeds: Next starts at Min, grows by Factor (2 when zero) up to Max,
// and is spread ±20%; Reset starts it again after a success.
type Growing struct {
	Min, Max time.Duration
	Factor   float64
	n        int
}

// Next returns the next delay.
func (g *Growing) Next() time.Duration {
	if g.n < math.MaxInt32 {
		g.n++
	}
	f := g.Factor
	if f == 0 {
		f = 2
	}
	return Spread(Pow(g.Min, g.Max, f, g.n))
}

// Reset makes the next delay Min again.
func (g *Growing) Reset() { g.n = 0 }

// Sleep waits d or until ctx ends. It reports whether d passed: false when
// ctx was done first (or already), true at once for d ≤ 0.
func Sleep(ctx context.Context, d time.Duration) bool {
	if ctx.Err() != nil {
		return false
	}
	if d <= 0 {
		return true
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
