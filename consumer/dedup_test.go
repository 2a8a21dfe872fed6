package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/testkit/clocktest"
)

// effects is the oracle: every side effect a handler performs is appended,
// with no uniqueness check, and counted afterwards.
type effects struct {
	mu   sync.Mutex
	list []string
}

func (e *effects) add(id string) {
	e.mu.Lock()
	e.list = append(e.list, id)
	e.mu.Unlock()
}

// counts returns how many times each id's effect happened.
func (e *effects) counts() map[string]int {
	e.mu.Lock()
	defer e.mu.Unlock()
	c := make(map[string]int)
	for _, id := range e.list {
		c[id]++
	}
	return c
}

func TestDedupConcurrentDeliveries(t *testing.T) {
	store := newStore(t, memstore.Options{})
	const n = 100
	var fx effects
	var ran, returned atomic.Int64
	others := make(chan struct{}) // closed once every other delivery returned
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		fx.add(m.ID)
		if ran.Add(1) == 1 {
			<-others // hold the lease while the others pile up
		}
		return nil
	}), mustDedup(t, store, consumer.DedupOptions{Scope: "billing/charge"}))

	results := make([]consumer.Result, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			m := msg("order-1", `{"amount":100}`)
			results[i] = consumer.Process(t.Context(), h, m)
			if returned.Add(1) == n-1 {
				close(others)
			}
		})
	}
	close(start)
	wg.Wait()

	if c := fx.counts()["order-1"]; c != 1 {
		t.Fatalf("effect happened %d times, want exactly 1", c)
	}
	var firsts, dups, inFlight int
	for _, r := range results {
		switch {
		case r.Action == consumer.ActionAck && !r.Duplicate && r.Reason == "":
			firsts++
		case r.Action == consumer.ActionAck && r.Duplicate:
			dups++
		case r.Action == consumer.ActionRetry && r.Reason == consumer.OutcomeInFlight:
			inFlight++
			if r.RetryAfter <= 0 {
				t.Errorf("in-flight result without RetryAfter: %+v", r)
			}
		default:
			t.Errorf("unexpected result %+v", r)
		}
	}
	if firsts != 1 || firsts+dups+inFlight != n {
		t.Fatalf("firsts=%d duplicates=%d in-flight=%d, want 1 first and the rest duplicate or in flight", firsts, dups, inFlight)
	}
}

// With Retry around Dedup, in-flight deliveries wait for the first owner and
// become duplicates: every delivery is acknowledged, the effect happens once
// per id.
func TestDedupConcurrentWithRetryAllAck(t *testing.T) {
	store := newStore(t, memstore.Options{})
	var fx effects
	const ids, perID = 10, 20

	var mu sync.Mutex
	completed := make(map[string]chan struct{})
	doneCh := func(id string) chan struct{} {
		mu.Lock()
		defer mu.Unlock()
		if completed[id] == nil {
			completed[id] = make(chan struct{})
		}
		return completed[id]
	}
	var once sync.Map
	dd := mustDedup(t, store, consumer.DedupOptions{
		Scope: "billing/charge",
		Telemetry: consumer.Telemetry{OnOutcome: func(_ context.Context, r consumer.Report) {
			m, o := r.Message, r.Outcome
			if o == consumer.OutcomeCompleted {
				if _, loaded := once.LoadOrStore(m.ID, true); !loaded {
					close(doneCh(m.ID))
				}
			}
		}},
	})
	// The first owner of an id finishes only once another delivery of it
	// found the key in flight and waits in Retry.
	waiting := func(id string) chan struct{} { return doneCh("waiting/" + id) }
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		fx.add(m.ID)
		consumer.SetResult(ctx, []byte("receipt-"+m.ID))
		<-waiting(m.ID)
		return nil
	}), nil, dd)

	var wg sync.WaitGroup
	var acked, dups atomic.Int64
	start := make(chan struct{})
	for i := range ids {
		id := fmt.Sprintf("order-%d", i)
		// Retry sleeps until the first owner of this id completed: the
		// retries are deterministic, not timed.
		retry := mustRetry(t, consumer.RetryOptions{
			MaxAttempts: 10,
			Sleep: func(ctx context.Context, d time.Duration) error {
				if _, loaded := once.LoadOrStore("waiting/"+id, true); !loaded {
					close(waiting(id))
				}
				select {
				case <-doneCh(id):
					return nil
				case <-ctx.Done():
					return ctx.Err()
				}
			},
		})
		rh := consumer.Chain(h, retry)
		for range perID {
			wg.Go(func() {
				<-start
				r := consumer.Process(t.Context(), rh, msg(id, "payload-"+id))
				if r.Action != consumer.ActionAck {
					t.Errorf("%s: result %+v, want every delivery acknowledged", id, r)
					return
				}
				acked.Add(1)
				if r.Duplicate {
					dups.Add(1)
					if res, ok := dedup.StoredResult(r.Err); !ok || string(res) != "receipt-"+id {
						t.Errorf("%s: duplicate carries result %q (ok=%v), want the first owner's", id, res, ok)
					}
				}
			})
		}
	}
	close(start)
	wg.Wait()
	for i := range ids {
		id := fmt.Sprintf("order-%d", i)
		if c := fx.counts()[id]; c != 1 {
			t.Errorf("%s: effect happened %d times, want exactly 1", id, c)
		}
	}
	if acked.Load() != ids*perID || dups.Load() != ids*(perID-1) {
		t.Fatalf("acked=%d duplicates=%d, want %d and %d", acked.Load(), dups.Load(), ids*perID, ids*(perID-1))
	}
}

func TestDedupFailureReleases(t *testing.T) {
	cs := &countingStore{LeaseStore: newStore(t, memstore.Options{})}
	var fx effects
	fail := true
	var outcomes []string
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if fail {
			return errBoom
		}
		fx.add(m.ID)
		if !consumer.SetResult(ctx, []byte("receipt")) {
			t.Error("SetResult under Dedup returned false")
		}
		return nil
	}), mustDedup(t, cs, consumer.DedupOptions{Telemetry: consumer.Telemetry{OnOutcome: func(_ context.Context, r consumer.Report) {
		outcomes = append(outcomes, string(r.Outcome))
	}}}))
	ctx := t.Context()

	r := consumer.Process(ctx, h, msg("m1", "p"))
	wantResult(t, r, consumer.ActionRetry, consumer.OutcomeTransient)
	if r.Err != errBoom {
		t.Fatalf("Result.Err = %v, want the handler's error unchanged", r.Err)
	}
	if cs.releases.Load() != 1 {
		t.Fatalf("releases = %d, want 1", cs.releases.Load())
	}

	fail = false
	wantResult(t, consumer.Process(ctx, h, msg("m1", "p")), consumer.ActionAck, "")
	r = consumer.Process(ctx, h, msg("m1", "p"))
	wantResult(t, r, consumer.ActionAck, consumer.OutcomeDuplicate)
	if res, ok := dedup.StoredResult(r.Err); !ok || string(res) != "receipt" {
		t.Fatalf("StoredResult = %q, %v; want the handler's result", res, ok)
	}
	if c := fx.counts()["m1"]; c != 1 {
		t.Fatalf("effect happened %d times, want 1", c)
	}
	if got, want := strings.Join(outcomes, ","), "released,completed,duplicate"; got != want {
		t.Fatalf("outcomes %s, want %s", got, want)
	}
	if consumer.SetResult(ctx, []byte("x")) {
		t.Fatal("SetResult outside Dedup returned true")
	}
}

func TestDedupPanicReleasesAndRecoverConverts(t *testing.T) {
	store := newStore(t, memstore.Options{})
	cs := &countingStore{LeaseStore: store}
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		panic("poison")
	}), consumer.Recover(), mustDedup(t, cs, consumer.DedupOptions{Scope: "s", ExtendEvery: time.Millisecond}))

	r := consumer.Process(t.Context(), h, msg("m1", "p"))
	wantResult(t, r, consumer.ActionDeadLetter, consumer.OutcomePanic)
	var pe *consumer.PanicError
	if !errors.As(r.Err, &pe) || pe.Value != "poison" || !strings.Contains(string(pe.Stack), "TestDedupPanicReleasesAndRecoverConverts") {
		t.Fatalf("Result.Err = %v, want a PanicError with the handler's value and stack", r.Err)
	}
	if cs.releases.Load() != 1 {
		t.Fatalf("releases = %d, want 1", cs.releases.Load())
	}
	// The key was given back: a new claim gets a lease.
	l, err := store.Claim(t.Context(), dedup.NewKey("s", "m1", []byte("p")))
	if err != nil || l == nil {
		t.Fatalf("claim after the panic = %v, want a lease", err)
	}
}

// The heartbeat keeps a short lease alive while a long handler runs: nobody
// else gets in. No time is asserted, only that Extend was called and that no
// second owner got the key.
func TestDedupHeartbeatExtends(t *testing.T) {
	// In a synctest bubble the clock is the bubble's: the handler's pause,
	// the heartbeat and the competing claims run on it, and the store's
	// leases expire by it.
	synctest.Test(t, func(t *testing.T) {
		// A lease of a second against beats every 20ms.
		store := newStore(t, memstore.Options{Lease: time.Second})
		cs := &countingStore{LeaseStore: store}
		key := dedup.NewKey("s", "slow", []byte("p"))
		handlerDone := make(chan struct{})
		h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			defer close(handlerDone)
			time.Sleep(2200 * time.Millisecond) // more than two leases
			return ctx.Err()
		}), mustDedup(t, cs, consumer.DedupOptions{Scope: "s", ExtendEvery: 20 * time.Millisecond}))

		var stolen atomic.Int64
		var others []error
		var wg sync.WaitGroup
		wg.Go(func() {
			for {
				select {
				case <-handlerDone:
					return
				case <-time.After(10 * time.Millisecond):
				}
				l, err := store.Claim(context.Background(), key)
				if l != nil {
					stolen.Add(1)
				}
				if err != nil && !errors.Is(err, dedup.ErrInFlight) && !errors.Is(err, dedup.ErrDuplicate) {
					others = append(others, err)
				}
			}
		})
		r := consumer.Process(t.Context(), h, msg("slow", "p"))
		wg.Wait()
		wantResult(t, r, consumer.ActionAck, "")
		if stolen.Load() != 0 {
			t.Fatalf("a second owner claimed the key %d times while the handler ran", stolen.Load())
		}
		if len(others) > 0 {
			t.Fatalf("competing claims failed unexpectedly: %v", others)
		}
		if cs.extends.Load() == 0 {
			t.Fatal("Extend was never called")
		}
		if _, err := store.Claim(t.Context(), key); !errors.Is(err, dedup.ErrDuplicate) {
			t.Fatalf("claim after completion = %v, want duplicate", err)
		}
	})
}

// When the lease expires and a second owner takes the key, the heartbeat's
// Extend fails and the handler's context is cancelled with ErrLeaseLost.
func TestDedupLeaseLostCancelsHandler(t *testing.T) {
	clock := clocktest.NewManual(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	store := newStore(t, memstore.Options{Lease: time.Second, Clock: clock})
	cs := &countingStore{LeaseStore: store}
	started := make(chan struct{})
	var cause error
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		close(started)
		<-ctx.Done()
		cause = context.Cause(ctx)
		return consumer.Permanent(fmt.Errorf("aborted: %w", ctx.Err()))
	}), mustDedup(t, cs, consumer.DedupOptions{Scope: "s", ExtendEvery: 2 * time.Millisecond}))

	res := make(chan consumer.Result, 1)
	go func() { res <- consumer.Process(t.Context(), h, msg("m1", "p")) }()
	<-started
	clock.Advance(2 * time.Second)
	second, err := store.Claim(t.Context(), dedup.NewKey("s", "m1", []byte("p")))
	if err != nil {
		t.Fatalf("second owner's claim after expiry = %v, want a lease", err)
	}
	r := <-res
	if !errors.Is(cause, dedup.ErrLeaseLost) {
		t.Fatalf("handler context cause = %v, want ErrLeaseLost", cause)
	}
	// The handler said Permanent, but the lease was lost: the redelivery
	// must find the new owner's state, not a dead letter.
	wantResult(t, r, consumer.ActionRetry, consumer.OutcomeLeaseLost)
	if cs.releases.Load() != 0 || cs.completes.Load() != 0 {
		t.Fatalf("stale owner called Release %d and Complete %d times, want 0", cs.releases.Load(), cs.completes.Load())
	}
	// The new owner's lease is intact.
	if err := store.Complete(t.Context(), second, nil); err != nil {
		t.Fatalf("second owner's Complete = %v", err)
	}
}

func TestDedupStoreDownFailsClosed(t *testing.T) {
	store := newStore(t, memstore.Options{})
	_ = store.Close()
	ran := false
	var outcome consumer.Outcome
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		ran = true
		return nil
	}), mustDedup(t, store, consumer.DedupOptions{Telemetry: consumer.Telemetry{OnOutcome: func(_ context.Context, r consumer.Report) { outcome = r.Outcome }}}))
	r := consumer.Process(t.Context(), h, msg("m1", "p"))
	wantResult(t, r, consumer.ActionRetry, consumer.OutcomeTransient)
	if ran {
		t.Fatal("handler ran while the store was down")
	}
	if !errors.Is(r.Err, dedup.ErrClosed) || outcome != consumer.OutcomeStoreError {
		t.Fatalf("err %v outcome %q, want ErrClosed and store_error", r.Err, outcome)
	}
}

func TestDedupFingerprintMismatch(t *testing.T) {
	store := newStore(t, memstore.Options{})
	var runs int
	inner := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { runs++; return nil })
	dd := mustDedup(t, store, consumer.DedupOptions{})
	wantResult(t, consumer.Process(t.Context(), consumer.Chain(inner, dd), msg("m1", "amount=100")), consumer.ActionAck, "")

	// Without DeadLetter: the adapter is told to dead-letter it.
	r := consumer.Process(t.Context(), consumer.Chain(inner, dd), msg("m1", "amount=999"))
	wantResult(t, r, consumer.ActionDeadLetter, consumer.OutcomeFingerprintMismatch)

	// With the full chain: the hook gets it, then it is acknowledged.
	var hooked []consumer.Outcome
	var hookCause error
	h := consumer.Chain(inner,
		mustDeadLetter(t, func(_ context.Context, m *consumer.Message, reason consumer.Outcome, cause error) error {
			hooked = append(hooked, reason)
			hookCause = cause
			return nil
		}),
		mustRetry(t, consumer.RetryOptions{Sleep: noSleep}),
		consumer.Recover(),
		consumer.Timeout(time.Minute),
		dd)
	r = consumer.Process(t.Context(), h, msg("m1", "amount=999"))
	if r.Action != consumer.ActionAck || !r.DeadLettered || r.Reason != consumer.OutcomeFingerprintMismatch {
		t.Fatalf("result %+v, want ack, dead-lettered, fingerprint_mismatch", r)
	}
	if len(hooked) != 1 || hooked[0] != consumer.OutcomeFingerprintMismatch || !errors.Is(hookCause, dedup.ErrFingerprintMismatch) {
		t.Fatalf("hook got %v (cause %v), want one fingerprint_mismatch", hooked, hookCause)
	}
	if runs != 1 {
		t.Fatalf("handler ran %d times, want 1 (only the original)", runs)
	}
}

func TestDedupInvalidKey(t *testing.T) {
	cs := &countingStore{LeaseStore: newStore(t, memstore.Options{})}
	ran := false
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { ran = true; return nil }),
		mustDedup(t, cs, consumer.DedupOptions{}))
	for name, id := range map[string]string{
		"empty":        "",
		"control byte": "a\x00b",
		"newline":      "a\nb",
		"too long":     strings.Repeat("x", dedup.DefaultMaxKeyLen+1),
		"bad utf8":     "\xff\xfe",
	} {
		t.Run(name, func(t *testing.T) {
			r := consumer.Process(t.Context(), h, msg(id, "p"))
			wantResult(t, r, consumer.ActionDeadLetter, consumer.OutcomeInvalidKey)
			if !errors.Is(r.Err, dedup.ErrInvalidKey) {
				t.Fatalf("err %v does not wrap ErrInvalidKey", r.Err)
			}
		})
	}
	if ran || cs.claims.Load() != 0 {
		t.Fatalf("handler ran=%v, claims=%d; want neither for invalid keys", ran, cs.claims.Load())
	}
	// A longer limit (matching the store's) lets a longer id through.
	long := mustDedup(t, newStore(t, memstore.Options{MaxKeyLen: 1000}), consumer.DedupOptions{MaxKeyLen: 1000})
	ok := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	wantResult(t, consumer.Process(t.Context(), consumer.Chain(ok, long), msg(strings.Repeat("x", 300), "p")), consumer.ActionAck, "")
}

func TestDedupKeyFuncAndFingerprint(t *testing.T) {
	store := newStore(t, memstore.Options{})
	runs := 0
	inner := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { runs++; return nil })
	h := consumer.Chain(inner, mustDedup(t, store, consumer.DedupOptions{
		KeyFunc: func(m *consumer.Message) (string, error) {
			switch id := m.Headers["ce_id"]; id {
			case "broken":
				return "", errBoom
			case "poison":
				return "", consumer.Permanent(errBoom)
			default:
				return id, nil
			}
		},
		Fingerprint: func(*consumer.Message) dedup.Fingerprint { return dedup.Fingerprint{} },
	}))
	with := func(ceID, payload string) *consumer.Message {
		m := msg("ignored", payload)
		m.Headers = map[string]string{"ce_id": ceID}
		return m
	}
	wantResult(t, consumer.Process(t.Context(), h, with("e1", "a")), consumer.ActionAck, "")
	// Fingerprint disabled: other content under the same id is a duplicate.
	wantResult(t, consumer.Process(t.Context(), h, with("e1", "b")), consumer.ActionAck, consumer.OutcomeDuplicate)
	wantResult(t, consumer.Process(t.Context(), h, with("", "a")), consumer.ActionDeadLetter, consumer.OutcomeInvalidKey)
	wantResult(t, consumer.Process(t.Context(), h, with("broken", "a")), consumer.ActionRetry, consumer.OutcomeTransient)
	wantResult(t, consumer.Process(t.Context(), h, with("poison", "a")), consumer.ActionDeadLetter, consumer.OutcomePermanent)
	if runs != 1 {
		t.Fatalf("handler ran %d times, want 1", runs)
	}
}

func TestDedupScopesAreIndependent(t *testing.T) {
	store := newStore(t, memstore.Options{})
	var fx effects
	mk := func(scope string) consumer.Handler {
		return consumer.Chain(consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
			fx.add(scope)
			return nil
		}), mustDedup(t, store, consumer.DedupOptions{Scope: scope}))
	}
	email, ledger := mk("notify/email"), mk("billing/ledger")
	for range 3 {
		consumer.Process(t.Context(), email, msg("order-1", "p"))
		consumer.Process(t.Context(), ledger, msg("order-1", "p"))
	}
	if c := fx.counts(); c["notify/email"] != 1 || c["billing/ledger"] != 1 {
		t.Fatalf("effects %v, want each scope once", c)
	}
}

// A handler that succeeds as the consumer stops is still recorded: Complete
// runs without the cancelled context.
func TestDedupCompletesAfterCancel(t *testing.T) {
	store := newStore(t, memstore.Options{})
	ctx, cancel := context.WithCancel(t.Context())
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		cancel()
		return nil
	}), mustDedup(t, store, consumer.DedupOptions{Scope: "s"}))
	wantResult(t, consumer.Process(ctx, h, msg("m1", "p")), consumer.ActionAck, "")
	if _, err := store.Claim(t.Context(), dedup.NewKey("s", "m1", []byte("p"))); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("claim after completion = %v, want duplicate", err)
	}
}

type failingCompleteStore struct {
	dedup.LeaseStore
	err error
}

func (s failingCompleteStore) Complete(context.Context, *dedup.Lease, []byte) error { return s.err }

func TestDedupCompleteFails(t *testing.T) {
	store := newStore(t, memstore.Options{})
	ok := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	for _, c := range []struct {
		err    error
		reason consumer.Outcome
	}{
		{errBoom, consumer.OutcomeTransient},
		{fmt.Errorf("token mismatch: %w", dedup.ErrLeaseLost), consumer.OutcomeLeaseLost},
	} {
		var outcome consumer.Outcome
		h := consumer.Chain(ok, mustDedup(t, failingCompleteStore{store, c.err}, consumer.DedupOptions{
			Telemetry: consumer.Telemetry{OnOutcome: func(_ context.Context, r consumer.Report) { outcome = r.Outcome }},
		}))
		r := consumer.Process(t.Context(), h, msg("m-"+string(c.reason), "p"))
		wantResult(t, r, consumer.ActionRetry, c.reason)
		if !errors.Is(r.Err, c.err) || outcome != consumer.OutcomeCompleteFailed {
			t.Fatalf("err %v outcome %q, want %v and complete_failed", r.Err, outcome, c.err)
		}
	}
}

func TestDedupOptionErrors(t *testing.T) {
	store := newStore(t, memstore.Options{})
	for name, c := range map[string]struct {
		store dedup.LeaseStore
		opts  consumer.DedupOptions
		want  string
	}{
		"nil store":        {nil, consumer.DedupOptions{Scope: "s"}, "store"},
		"empty scope":      {store, consumer.DedupOptions{}, "Scope"},
		"control in scope": {store, consumer.DedupOptions{Scope: "a\tb"}, "Scope"},
		"long scope":       {store, consumer.DedupOptions{Scope: strings.Repeat("s", 256)}, "Scope"},
		"negative maxlen":  {store, consumer.DedupOptions{Scope: "s", MaxKeyLen: -1}, "MaxKeyLen"},
		"negative finish":  {store, consumer.DedupOptions{Scope: "s", FinishTimeout: -1}, "FinishTimeout"},
	} {
		t.Run(name, func(t *testing.T) {
			mw, err := consumer.Dedup(c.store, c.opts)
			if err == nil || mw != nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Dedup = %v, want an error naming %s", err, c.want)
			}
		})
	}
}

// During a graceful stop a handler may finish its work after the consumer's
// context is cancelled: the heartbeat keeps its lease until it returns.
func TestDedupHeartbeatOutlivesConsumerContext(t *testing.T) {
	cs := &countingStore{LeaseStore: newStore(t, memstore.Options{})}
	ctx, cancel := context.WithCancel(t.Context())
	h := consumer.Chain(consumer.HandlerFunc(func(hctx context.Context, m *consumer.Message) error {
		cancel()
		n := cs.extends.Load()
		for cs.extends.Load() < n+3 {
			select {
			case <-t.Context().Done():
				return t.Context().Err()
			case <-time.After(time.Millisecond):
			}
		}
		return nil
	}), mustDedup(t, cs, consumer.DedupOptions{Scope: "s", ExtendEvery: time.Millisecond}))
	wantResult(t, consumer.Process(ctx, h, msg("m1", "p")), consumer.ActionAck, "")
	if _, err := cs.Claim(t.Context(), dedup.NewKey("s", "m1", []byte("p"))); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("claim after completion = %v, want duplicate", err)
	}
}
