package main

import (
	"fmt"
	mrand "math/rand/v2"
	"strconv"
	"sync"
)

// plan decides the run from the seed, before it starts: each payment, its
// double click and lost response, the consumer crashes it causes, and the
// relay crashes. Each decision is a function of the seed and the payment's
// number (or the relay block's), whatever the goroutines do meanwhile, so
// that a run in this process repeats with its seed; and payments are made
// one at a time, so that none is held longer than its submission.
type plan struct {
	cfg   demoConfig
	runID string
}

// The streams of the seed's generator, one per kind of decision.
const (
	streamPayment = iota + 1
	streamRelay
)

// rng returns the generator of decision n of a stream.
func (pl *plan) rng(stream, n uint64) *mrand.Rand {
	// PCG's first outputs for neighbouring seeds are alike: mix first.
	a := splitmix(pl.cfg.seed ^ splitmix(stream<<56|n))
	return mrand.New(mrand.NewPCG(a, splitmix(a)))
}

// splitmix is SplitMix64's mixing function.
func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

// payment returns payment n.
func (pl *plan) payment(n int) payment {
	r := pl.rng(streamPayment, uint64(n))
	return payment{
		n:           n,
		key:         fmt.Sprintf("pay-%s-%06d", pl.runID, n),
		customer:    "customer-" + strconv.Itoa(r.IntN(500)),
		cents:       100 + r.Int64N(99900),
		doubleClick: r.Float64() < pl.cfg.doubleClicks,
		loseFirst:   r.Float64() < pl.cfg.timeouts,
		crash: [2]bool{
			r.Float64() < pl.cfg.crashRate,
			r.Float64() < pl.cfg.crashRate,
		},
	}
}

// crashes reports whether the consumer group of path crashes after it
// handled payment n's first delivery, before it committed it (in this
// process: the child processes are SIGKILLed at random instead).
func (pl *plan) crashes(path string, n int) bool {
	i := 0
	if path == pathIdem {
		i = 1
	}
	return pl.payment(n).crash[i]
}

// relayCrashes reports whether the relay crashes after publishing the
// messages of payments block*relayBatch to (block+1)*relayBatch-1, before
// marking them sent: it publishes them again.
func (pl *plan) relayCrashes(block int) bool {
	return pl.rng(streamRelay, uint64(block)).Float64() < pl.cfg.republishes
}

// relayBlocks returns the number of relay blocks that crash.
func (pl *plan) relayBlocks() (crashed int64) {
	for b := range (pl.cfg.payments + relayBatch - 1) / relayBatch {
		if pl.relayCrashes(b) {
			crashed++
		}
	}
	return crashed
}

// lockedRand is a rand.Rand safe for concurrent use.
type lockedRand struct {
	mu sync.Mutex
	r  *mrand.Rand
}

func (l *lockedRand) Float64() float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.Float64()
}
