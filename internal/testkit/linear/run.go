package linear

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/idemkit/idem/dedup"
)

// State is a key's state as a Read sees it.
type State uint8

// The states a Read answers.
const (
	StateAbsent State = iota
	StateHeld
	StateDone
)

// Target is a lease store under test.
type Target struct {
	Store dedup.LeaseStore
	// Read reads a key's state without changing it; nil when the store
	// has no such read (no Read operations are made then).
	Read func(ctx context.Context, key dedup.Key) (State, error)
}

// Workload shapes a run. Lease and TTL must be the store's.
type Workload struct {
	// Scope is the scope of every key; give each test its own.
	Scope string
	// Clients is the number of concurrent clients. Defaults to 8.
	Clients int
	// Keys is how many keys the clients share. Defaults to 3.
	Keys int
	// Ops is how many operations each client makes. Defaults to 60.
	Ops int
	// Lease and TTL are the store's lease and retention of done marks.
	Lease, TTL time.Duration
	// CallTimeout bounds each call. Defaults to 2s.
	CallTimeout time.Duration
}

func (w *Workload) defaults() {
	if w.Clients == 0 {
		w.Clients = 8
	}
	if w.Keys == 0 {
		w.Keys = 3
	}
	if w.Ops == 0 {
		w.Ops = 60
	}
	if w.CallTimeout == 0 {
		w.CallTimeout = 2 * time.Second
	}
}

// RunLease runs w's clients on target and returns their history. Each
// client repeats: read a key (when the target can), or claim one and,
// when granted, maybe extend it, then complete it, release it, leave it to
// run out, or wait past its lease and then complete or release it (a stale
// owner); a claim not granted is followed by a pause of up to a fifth of
// the lease. during runs beside the clients (faults), with a context that
// ends when the clients are done; RunLease waits for it.
func RunLease(ctx context.Context, target Target, w Workload, during func(ctx context.Context)) *History {
	w.defaults()
	h := NewHistory()
	key := func(r *rand.Rand) dedup.Key {
		return dedup.Key{Scope: w.Scope, ID: fmt.Sprintf("k%d", r.IntN(w.Keys))}
	}
	call := func(f func(ctx context.Context)) {
		cctx, cancel := context.WithTimeout(ctx, w.CallTimeout)
		defer cancel()
		f(cctx)
	}
	settle := func(c int, kind Kind, l *dedup.Lease) {
		in := Input{Kind: kind, Key: l.Key.ID, Token: l.Token, Call: h.Now()}
		var err error
		call(func(ctx context.Context) {
			switch kind {
			case Extend:
				err = target.Store.Extend(ctx, l)
			case Complete:
				err = target.Store.Complete(ctx, l, nil)
			case Release:
				err = target.Store.Release(ctx, l)
			}
		})
		h.Add(c, in, LeaseOutput(err), h.Now())
	}
	client := func(c int) {
		r := rand.New(rand.NewPCG(uint64(c), uint64(time.Now().UnixNano())))
		for range w.Ops {
			if ctx.Err() != nil {
				return
			}
			k := key(r)
			if target.Read != nil && r.IntN(6) == 0 {
				in := Input{Kind: Read, Key: k.ID, Call: h.Now()}
				var st State
				var err error
				call(func(ctx context.Context) { st, err = target.Read(ctx, k) })
				out := Output{Result: [...]Result{Absent, Held, Done}[st]}
				if err != nil {
					out = unknown(err)
				}
				h.Add(c, in, out, h.Now())
				continue
			}
			in := Input{Kind: Claim, Key: k.ID, Call: h.Now()}
			var l *dedup.Lease
			var err error
			call(func(ctx context.Context) { l, err = target.Store.Claim(ctx, k) })
			out := ClaimOutput(l, err)
			h.Add(c, in, out, h.Now())
			if out.Result != Granted {
				// A consumer's retry delay: without it, a done key
				// would spend the run's operations in a loop of
				// duplicates.
				sleep(ctx, time.Duration(r.Int64N(int64(w.Lease/5)+1)))
				continue
			}
			if r.IntN(3) == 0 {
				settle(c, Extend, l)
			}
			switch p := r.IntN(20); {
			case p < 9:
				settle(c, Complete, l)
			case p < 15:
				settle(c, Release, l)
			case p < 17:
				// Left to run out, as by a crashed worker.
			default:
				sleep(ctx, w.Lease+w.Lease/4)
				if p == 17 {
					settle(c, Complete, l)
				} else {
					settle(c, Release, l)
				}
			}
		}
	}
	runClients(ctx, w.Clients, client, during)
	return h
}

// errFnFailed is what fn returns in the Process calls that fail on
// purpose.
var errFnFailed = errors.New("linear: fn failed on purpose")

// ProcessFunc runs one Process of a TxStore whose fn returns value (or
// fails with fnErr when it is not nil); it returns Process's result and
// error.
type ProcessFunc func(ctx context.Context, key dedup.Key, value string, fnErr error) ([]byte, error)

// RunTx runs w's clients on a dedup.TxStore through process: each client
// processes random keys of w, with a result unique to the call, and one
// call in eight fails in fn. Lease and TTL of w are not used.
func RunTx(ctx context.Context, process ProcessFunc, w Workload, during func(ctx context.Context)) *History {
	w.defaults()
	h := NewHistory()
	client := func(c int) {
		r := rand.New(rand.NewPCG(uint64(c), uint64(time.Now().UnixNano())))
		for i := range w.Ops {
			if ctx.Err() != nil {
				return
			}
			k := dedup.Key{Scope: w.Scope, ID: fmt.Sprintf("k%d", r.IntN(w.Keys))}
			value := fmt.Sprintf("c%d-%d", c, i)
			var fnErr error
			if r.IntN(8) == 0 {
				fnErr = errFnFailed
			}
			in := Input{Kind: Process, Key: k.ID, Value: value, Call: h.Now()}
			cctx, cancel := context.WithTimeout(ctx, w.CallTimeout)
			res, err := process(cctx, k, value, fnErr)
			cancel()
			var out Output
			switch stored, dup := dedup.StoredResult(err); {
			case err == nil:
				out = Output{Result: OK, Value: string(res)}
			case dup:
				out = Output{Result: Duplicate, Value: string(stored)}
			case errors.Is(err, dedup.ErrInFlight):
				out = Output{Result: InFlight}
			case errors.Is(err, errFnFailed):
				out = Output{Result: Failed}
			default:
				out = unknown(err)
			}
			h.Add(c, in, out, h.Now())
		}
	}
	runClients(ctx, w.Clients, client, during)
	return h
}

func runClients(ctx context.Context, n int, client func(int), during func(context.Context)) {
	dctx, stop := context.WithCancel(ctx)
	var faults sync.WaitGroup
	if during != nil {
		faults.Go(func() { during(dctx) })
	}
	var wg sync.WaitGroup
	for c := range n {
		wg.Go(func() { client(c) })
	}
	wg.Wait()
	stop()
	faults.Wait()
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
