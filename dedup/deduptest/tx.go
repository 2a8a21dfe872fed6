package deduptest

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/dedup"
)

// TxHarness tells RunTx how to make transactional stores.
type TxHarness[Tx any] struct {
	// New returns a store isolated from every other instance.
	New func(t testing.TB) dedup.TxStore[Tx]
	// Down returns a store whose backend is unreachable.
	Down func(t testing.TB) dedup.TxStore[Tx]
	// Expire makes the store forget every completed key, the way its
	// retention cleanup does once the keys are old enough (for example by
	// back-dating rows and running the cleanup).
	Expire func(t testing.TB, s dedup.TxStore[Tx])
	// Concurrency is the number of goroutines that race for one key.
	// Defaults to 100.
	Concurrency int
}

// RunTx runs the transactional conformance suite.
func RunTx[Tx any](t *testing.T, h TxHarness[Tx]) {
	if h.New == nil {
		t.Fatal("deduptest: TxHarness.New is nil")
	}
	if h.Concurrency <= 0 {
		h.Concurrency = 100
	}
	t.Run("Concurrency", func(t *testing.T) { testTxConcurrency(t, h) })
	t.Run("RollbackReleases", func(t *testing.T) { testTxRollback(t, h) })
	t.Run("WaitsForFirst", func(t *testing.T) { testTxWaits(t, h) })
	t.Run("Scopes", func(t *testing.T) { testTxScopes(t, h) })
	t.Run("Fingerprint", func(t *testing.T) { testTxFingerprint(t, h) })
	t.Run("InvalidKeys", func(t *testing.T) { testTxInvalidKeys(t, h) })
	t.Run("StoreDown", func(t *testing.T) { testTxDown(t, h) })
	t.Run("TTLExpiry", func(t *testing.T) { testTxExpire(t, h) })
}

// processUntilSettled calls Process, retrying while the store answers
// ErrInFlight (a two-level store answers in-flight collisions from its cache
// instead of waiting on the database).
func processUntilSettled[Tx any](ctx context.Context, s dedup.TxStore[Tx], k dedup.Key, fn dedup.TxFunc[Tx]) ([]byte, error) {
	for {
		res, err := s.Process(ctx, k, fn)
		if !errors.Is(err, dedup.ErrInFlight) {
			return res, err
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func testTxConcurrency[Tx any](t *testing.T, h TxHarness[Tx]) {
	s := h.New(t)
	ctx := testCtx(t)
	key := dedup.NewKey(uniqueID("scope"), uniqueID("pay"), []byte(`{"amount":100}`))
	var runs atomic.Int64
	fn := func(ctx context.Context, tx Tx) ([]byte, error) {
		runs.Add(1)
		time.Sleep(20 * time.Millisecond) // hold the claim while the others pile up
		return []byte("receipt-1"), nil
	}
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firsts   int
		dups     int
		problems []error
		start    = make(chan struct{})
	)
	for range h.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			res, err := processUntilSettled(ctx, s, key, fn)
			stored, isDup := dedup.StoredResult(err)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil && string(res) == "receipt-1":
				firsts++
			case isDup && string(stored) == "receipt-1":
				dups++
			default:
				problems = append(problems, err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if len(problems) > 0 {
		t.Fatalf("%d callers got neither the receipt nor a duplicate with it: %v", len(problems), problems[0])
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("fn ran %d times, want exactly 1", n)
	}
	if firsts != 1 || dups != h.Concurrency-1 {
		t.Fatalf("firsts=%d duplicates=%d, want 1 and %d", firsts, dups, h.Concurrency-1)
	}
}

var errHandler = errors.New("deduptest: handler failed")

func testTxRollback[Tx any](t *testing.T, h TxHarness[Tx]) {
	s := h.New(t)
	ctx := testCtx(t)
	key := dedup.NewKey(uniqueID("scope"), uniqueID("pay"), []byte("p"))
	_, err := s.Process(ctx, key, func(context.Context, Tx) ([]byte, error) { return nil, errHandler })
	if !errors.Is(err, errHandler) {
		t.Fatalf("Process with a failing fn = %v, want the fn's error", err)
	}
	ran := false
	if _, err := processUntilSettled(ctx, s, key, func(context.Context, Tx) ([]byte, error) { ran = true; return nil, nil }); err != nil || !ran {
		t.Fatalf("redelivery after rollback: err=%v ran=%v, want it to run", err, ran)
	}
	if _, err := s.Process(ctx, key, func(context.Context, Tx) ([]byte, error) {
		t.Error("fn ran for a completed key")
		return nil, nil
	}); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("third delivery = %v, want ErrDuplicate", err)
	}

	// A panic in fn rolls back too, and the panic reaches the caller.
	pkey := dedup.NewKey(uniqueID("scope"), uniqueID("panic"), []byte("p"))
	func() {
		defer func() {
			if recover() == nil {
				t.Error("the panic of fn did not reach the caller")
			}
		}()
		_, _ = s.Process(ctx, pkey, func(context.Context, Tx) ([]byte, error) { panic("boom") })
	}()
	ran = false
	if _, err := processUntilSettled(ctx, s, pkey, func(context.Context, Tx) ([]byte, error) { ran = true; return nil, nil }); err != nil || !ran {
		t.Fatalf("redelivery after a panic: err=%v ran=%v, want it to run", err, ran)
	}
}

// testTxWaits: a duplicate that arrives while the first transaction is open
// does not run; if the first rolls back, the duplicate runs.
func testTxWaits[Tx any](t *testing.T, h TxHarness[Tx]) {
	s := h.New(t)
	ctx := testCtx(t)
	for _, firstFails := range []bool{true, false} {
		key := dedup.NewKey(uniqueID("scope"), uniqueID("pay"), []byte("p"))
		inFirst := make(chan struct{})
		finish := make(chan struct{})
		firstDone := make(chan error, 1)
		go func() {
			_, err := s.Process(ctx, key, func(context.Context, Tx) ([]byte, error) {
				close(inFirst)
				<-finish
				if firstFails {
					return nil, errHandler
				}
				return []byte("first"), nil
			})
			firstDone <- err
		}()
		<-inFirst
		var secondRan atomic.Bool
		secondDone := make(chan error, 1)
		go func() {
			_, err := processUntilSettled(ctx, s, key, func(context.Context, Tx) ([]byte, error) {
				secondRan.Store(true)
				return []byte("second"), nil
			})
			secondDone <- err
		}()
		time.Sleep(100 * time.Millisecond)
		if secondRan.Load() {
			t.Fatal("the duplicate ran while the first transaction was still open")
		}
		close(finish)
		errFirst, errSecond := <-firstDone, <-secondDone
		if firstFails {
			if !errors.Is(errFirst, errHandler) || errSecond != nil || !secondRan.Load() {
				t.Fatalf("first failed: first=%v second=%v ran=%v; want the second to run", errFirst, errSecond, secondRan.Load())
			}
		} else {
			if res, ok := dedup.StoredResult(errSecond); errFirst != nil || !ok || string(res) != "first" || secondRan.Load() {
				t.Fatalf("first committed: first=%v second=%v ran=%v; want a duplicate with the first's result", errFirst, errSecond, secondRan.Load())
			}
		}
	}
}

func testTxScopes[Tx any](t *testing.T, h TxHarness[Tx]) {
	s := h.New(t)
	ctx := testCtx(t)
	id := uniqueID("evt")
	var runs atomic.Int64
	fn := func(context.Context, Tx) ([]byte, error) { runs.Add(1); return nil, nil }
	for _, scope := range []string{uniqueID("billing"), uniqueID("email")} {
		k := dedup.NewKey(scope, id, []byte("same"))
		for i := range 2 {
			_, err := s.Process(ctx, k, fn)
			if i == 0 && err != nil {
				t.Fatalf("scope %s first: %v", scope, err)
			}
			if i == 1 && !errors.Is(err, dedup.ErrDuplicate) {
				t.Fatalf("scope %s second: %v, want ErrDuplicate", scope, err)
			}
		}
	}
	if runs.Load() != 2 {
		t.Fatalf("fn ran %d times for two scopes, want 2", runs.Load())
	}
}

func testTxFingerprint[Tx any](t *testing.T, h TxHarness[Tx]) {
	s := h.New(t)
	ctx := testCtx(t)
	scope, id := uniqueID("scope"), uniqueID("pay")
	a := dedup.NewKey(scope, id, []byte("100"))
	b := dedup.NewKey(scope, id, []byte("900"))
	if _, err := s.Process(ctx, a, func(context.Context, Tx) ([]byte, error) { return nil, nil }); err != nil {
		t.Fatal(err)
	}
	_, err := s.Process(ctx, b, func(context.Context, Tx) ([]byte, error) {
		t.Error("fn ran for a fingerprint mismatch")
		return nil, nil
	})
	if !errors.Is(err, dedup.ErrFingerprintMismatch) || errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("other content = %v, want ErrFingerprintMismatch only", err)
	}
	if _, err := s.Process(ctx, a, func(context.Context, Tx) ([]byte, error) { return nil, nil }); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("same content = %v, want ErrDuplicate", err)
	}
}

func testTxInvalidKeys[Tx any](t *testing.T, h TxHarness[Tx]) {
	s := h.New(t)
	ctx := testCtx(t)
	for name, k := range invalidKeys() {
		_, err := s.Process(ctx, k, func(context.Context, Tx) ([]byte, error) {
			t.Errorf("%s: fn ran", name)
			return nil, nil
		})
		if !errors.Is(err, dedup.ErrInvalidKey) {
			t.Errorf("%s: Process = %v, want ErrInvalidKey", name, err)
		}
	}
}

func testTxDown[Tx any](t *testing.T, h TxHarness[Tx]) {
	if h.Down == nil {
		t.Fatal("TxHarness.Down is nil: every store must show that it fails closed")
	}
	s := h.Down(t)
	ctx := testCtx(t)
	key := dedup.NewKey(uniqueID("scope"), uniqueID("pay"), []byte("p"))
	_, err := s.Process(ctx, key, func(context.Context, Tx) ([]byte, error) {
		t.Error("fn ran on a down store")
		return nil, nil
	})
	if err == nil || errors.Is(err, dedup.ErrDuplicate) || errors.Is(err, dedup.ErrInvalidKey) {
		t.Fatalf("Process on a down store = %v, want a store error", err)
	}
	t.Logf("down store: %v", err)
}

func testTxExpire[Tx any](t *testing.T, h TxHarness[Tx]) {
	if h.Expire == nil {
		t.Fatal("TxHarness.Expire is nil: every store must show its retention")
	}
	s := h.New(t)
	ctx := testCtx(t)
	key := dedup.NewKey(uniqueID("scope"), uniqueID("pay"), []byte("p"))
	var runs atomic.Int64
	fn := func(context.Context, Tx) ([]byte, error) { runs.Add(1); return nil, nil }
	if _, err := s.Process(ctx, key, fn); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Process(ctx, key, fn); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("before expiry: %v, want ErrDuplicate", err)
	}
	h.Expire(t, s)
	if _, err := processUntilSettled(ctx, s, key, fn); err != nil {
		t.Fatalf("after expiry: %v, want it to run", err)
	}
	if runs.Load() != 2 {
		t.Fatalf("fn ran %d times, want 2 (once before, once after expiry)", runs.Load())
	}
}
