package main

import (
	"context"
	"io"
	"runtime"
	"runtime/metrics"
	"strconv"
	"sync"
	"testing"
	"time"
)

// peakLiveHeap runs the embedded demo in process with payments and the
// dedup marks' TTL, and returns the largest live heap (what the last GC
// found reachable) seen while it ran.
func peakLiveHeap(t *testing.T, payments int, ttl time.Duration) uint64 {
	t.Helper()
	runtime.GC()
	sample := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	var peak uint64
	var mu sync.Mutex
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			metrics.Read(sample)
			mu.Lock()
			peak = max(peak, sample[0].Value.Uint64())
			mu.Unlock()
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	})
	start := time.Now()
	// The test bounds memory, not time: a loaded machine may need longer
	// than the demo's default limit.
	code := run(context.Background(), []string{"demo", "--payments", strconv.Itoa(payments), "--seed", "5", "--progress", "none",
		"--dedup-ttl", ttl.String(), "--timeout", "30m"}, io.Discard, io.Discard)
	close(done)
	wg.Wait()
	if code != 0 {
		t.Fatalf("demo --payments %d: exit status %d", payments, code)
	}
	took := time.Since(start)
	t.Logf("%d payments: peak live heap %.1f MB, %v (%.0f payments/s)", payments, float64(peak)/(1<<20), took, float64(payments)/took.Seconds())
	return peak
}

// TestDemoMemoryPerPayment runs the embedded demo at two sizes with a
// short --dedup-ttl and bounds how much its peak live heap grows per
// payment. A payment's dedup marks (the idempotency key's, with its stored
// response, and the charge's: about 400 bytes of heap in memstore) are
// swept once older than the TTL, so the demo holds the marks of the last 3
// seconds (the TTL, and a sweep every second) whatever the run's length.
// What remains per payment is the oracle's few counters (about 35 bytes),
// and the marks of the larger run's longer window when the demo is fast:
// at 10,000 payments a second, (30,000 - 10,000) marks of 400 bytes over
// 50,000 payments is 160 bytes, and faster than about 10,000 a second the
// bound no longer holds (on a 2-core machine the demo runs at about 6,000
// a second without the race detector). Marks kept for the whole run
// (about 500 bytes), the broker's log of every record (about 400) or maps
// of every delivery (about 700) exceed it. The demo's redeliveries (a retried request, a
// consumer restarted from its last commit, a batch published again)
// follow the first delivery closely; one that came after the TTL would be
// charged twice and fail the run, and the test with it.
func TestDemoMemoryPerPayment(t *testing.T) {
	const small, large = 10000, 60000
	const ttl = 2 * time.Second
	const perPayment = 200 // bytes
	a, b := peakLiveHeap(t, small, ttl), peakLiveHeap(t, large, ttl)
	growth := (float64(b) - float64(a)) / (large - small)
	t.Logf("growth: %.0f bytes per payment", growth)
	if growth > perPayment {
		t.Errorf("peak live heap grew by %.0f bytes per payment from %d to %d payments (%.1f MB to %.1f MB), want at most %d",
			growth, small, large, float64(a)/(1<<20), float64(b)/(1<<20), perPayment)
	}
}
