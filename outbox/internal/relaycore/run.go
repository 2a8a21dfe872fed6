package relaycore

import (
	"context"
	"errors"
	"sync"
	"time"
)

// Run runs each loop in its own goroutine until ctx ends or a loop calls
// stop, and waits for all of them. A loop stops the run for good with
// stop(err), err wrapping fatal: Run then returns err. Otherwise it
// returns nil.
func Run(ctx context.Context, fatal error, loops ...func(ctx context.Context, stop context.CancelCauseFunc)) error {
	runCtx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	var wg sync.WaitGroup
	for _, loop := range loops {
		wg.Go(func() { loop(runCtx, stop) })
	}
	wg.Wait()
	if cause := context.Cause(runCtx); errors.Is(cause, fatal) {
		return cause
	}
	return nil
}

// Graceful returns a context that is not cancelled by parent, only
// grace after parent ends, so work started before a shutdown may finish.
// Call the returned function when the work is done.
func Graceful(parent context.Context, grace time.Duration) (context.Context, func()) {
	ctx, cancel := context.WithCancel(context.WithoutCancel(parent))
	var (
		mu    sync.Mutex
		timer *time.Timer
		done  bool
	)
	stopAfter := context.AfterFunc(parent, func() {
		mu.Lock()
		defer mu.Unlock()
		if !done {
			timer = time.AfterFunc(grace, cancel)
		}
	})
	return ctx, func() {
		stopAfter()
		mu.Lock()
		done = true
		if timer != nil {
			timer.Stop()
		}
		mu.Unlock()
		cancel()
	}
}
