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

// peakLiveHeap runs the embedded demo in process with payments and returns
// the largest live heap (what the last GC found reachable) seen while it
// ran.
func peakLiveHeap(t *testing.T, payments int) uint64 {
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
	code := run(context.Background(), []string{"demo", "--payments", strconv.Itoa(payments), "--seed", "5", "--progress", "none", "--timeout", "30m"}, io.Discard, io.Discard)
	close(done)
	wg.Wait()
	if code != 0 {
		t.Fatalf("demo --payments %d: exit status %d", payments, code)
	}
	t.Logf("%d payments: peak live heap %.1f MB, %v", payments, float64(peak)/(1<<20), time.Since(start))
	return peak
}

// TestDemoMemoryPerPayment runs the embedded demo at two sizes and bounds
// how much its peak live heap grows per payment. What it must keep per
// payment is two dedup marks in memstore (the idempotency key's and the
// charge's: a 64-byte map slot each), the stored HTTP response of the
// idempotency key (a 32-byte slot and about 80 bytes), and the oracle's few
// counters (about 35 bytes). With the maps between 7/16 and 7/8 full that
// is 300 to 500 bytes; the bound leaves room for the broker's lag, which
// the demo's timing decides. Marks that kept their key's strings (about
// 250 bytes each), the broker's log of every record (about 400 bytes per
// payment) or maps of every delivery (about 700) would exceed it.
func TestDemoMemoryPerPayment(t *testing.T) {
	const small, large = 5000, 25000
	const perPayment = 600 // bytes
	a, b := peakLiveHeap(t, small), peakLiveHeap(t, large)
	growth := (float64(b) - float64(a)) / (large - small)
	t.Logf("growth: %.0f bytes per payment", growth)
	if growth > perPayment {
		t.Errorf("peak live heap grew by %.0f bytes per payment from %d to %d payments (%.1f MB to %.1f MB), want at most %d",
			growth, small, large, float64(a)/(1<<20), float64(b)/(1<<20), perPayment)
	}
}
