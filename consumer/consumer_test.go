package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// --- helpers ---

func newStore(t testing.TB, o memstore.Options) *memstore.Store {
	t.Helper()
	if o.SweepInterval == 0 {
		o.SweepInterval = -1
	}
	s, err := memstore.New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// countingStore counts the calls a LeaseStore gets.
type countingStore struct {
	dedup.LeaseStore
	claims, extends, completes, releases atomic.Int64
}

func (s *countingStore) Claim(ctx context.Context, k dedup.Key) (*dedup.Lease, error) {
	s.claims.Add(1)
	return s.LeaseStore.Claim(ctx, k)
}

func (s *countingStore) Extend(ctx context.Context, l *dedup.Lease) error {
	s.extends.Add(1)
	return s.LeaseStore.Extend(ctx, l)
}

func (s *countingStore) Complete(ctx context.Context, l *dedup.Lease, r []byte) error {
	s.completes.Add(1)
	return s.LeaseStore.Complete(ctx, l, r)
}

func (s *countingStore) Release(ctx context.Context, l *dedup.Lease) error {
	s.releases.Add(1)
	return s.LeaseStore.Release(ctx, l)
}

func mustDedup(t testing.TB, s dedup.LeaseStore, o consumer.DedupOptions) consumer.Middleware {
	t.Helper()
	if o.Scope == "" {
		o.Scope = "test/handler"
	}
	mw, err := consumer.Dedup(s, o)
	if err != nil {
		t.Fatal(err)
	}
	return mw
}

func mustRetry(t testing.TB, o consumer.RetryOptions) consumer.Middleware {
	t.Helper()
	mw, err := consumer.Retry(o)
	if err != nil {
		t.Fatal(err)
	}
	return mw
}

func mustDeadLetter(t testing.TB, hook func(context.Context, *consumer.Message, consumer.Outcome, error) error) consumer.Middleware {
	t.Helper()
	mw, err := consumer.DeadLetter(hook)
	if err != nil {
		t.Fatal(err)
	}
	return mw
}

// noSleep is a RetryOptions.Sleep that returns at once.
func noSleep(ctx context.Context, _ time.Duration) error { return ctx.Err() }

var errBoom = errors.New("boom")

func msg(id, payload string) *consumer.Message {
	return &consumer.Message{ID: id, Payload: []byte(payload), Topic: "orders", Attempt: 1}
}

func wantResult(t *testing.T, got consumer.Result, action consumer.Action, reason consumer.Outcome) {
	t.Helper()
	if got.Action != action || got.Reason != reason {
		t.Fatalf("result = %v/%q (err %v), want %v/%q", got.Action, got.Reason, got.Err, action, reason)
	}
}

// --- Chain, Permanent, Decide ---

func TestChainOrder(t *testing.T) {
	var trace []string
	mw := func(name string) consumer.Middleware {
		return func(next consumer.Handler) consumer.Handler {
			return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				trace = append(trace, name+">")
				err := next.Handle(ctx, m)
				trace = append(trace, "<"+name)
				return err
			})
		}
	}
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		trace = append(trace, "h")
		return nil
	}), mw("a"), nil, mw("b"))
	if err := h.Handle(context.Background(), msg("1", "")); err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(trace, " "), "a> b> h <b <a"; got != want {
		t.Fatalf("trace %q, want %q", got, want)
	}
}

func TestPermanent(t *testing.T) {
	if consumer.Permanent(nil) != nil {
		t.Fatal("Permanent(nil) != nil")
	}
	p := consumer.Permanent(errBoom)
	if !errors.Is(p, errBoom) || p.Error() != errBoom.Error() || !isPermanent(p) {
		t.Fatalf("Permanent(errBoom) = %v: Is=%v dead-lettered=%v", p, errors.Is(p, errBoom), isPermanent(p))
	}
	if consumer.Permanent(p) != p {
		t.Fatal("Permanent(Permanent(err)) wrapped twice")
	}
	if isPermanent(errBoom) || isPermanent(nil) {
		t.Fatal("plain errors and nil are not permanent")
	}
	for _, err := range []error{dedup.ErrFingerprintMismatch, dedup.ErrInvalidKey, &consumer.PanicError{Value: 1}} {
		if !isPermanent(err) {
			t.Errorf("Decide(%v) does not dead-letter it, want it to by nature", err)
		}
	}
	var pe *consumer.PanicError
	if !errors.As(consumer.Permanent(&consumer.PanicError{Value: "x"}), &pe) || pe.Value != "x" {
		t.Fatal("errors.As does not see a PanicError through Permanent")
	}
}

func TestActionString(t *testing.T) {
	for a, want := range map[consumer.Action]string{
		consumer.ActionAck: "ack", consumer.ActionRetry: "retry", consumer.ActionDeadLetter: "dead_letter", 0: "Action(0)",
	} {
		if got := a.String(); got != want {
			t.Errorf("Action(%d).String() = %q, want %q", int(a), got, want)
		}
	}
}

// decideCases returns the error kinds Decide knows, with the expected
// verdicts. It is shared with the fuzz test.
func decideCases() []struct {
	name   string
	err    error
	action consumer.Action
	reason consumer.Outcome
	dup    bool
	dl     bool
	after  time.Duration
} {
	key := dedup.Key{Scope: "s", ID: "i"}
	inFlight := &dedup.ClaimError{Err: dedup.ErrInFlight, Key: key, RetryAfter: 3 * time.Second}
	wrap := func(err error) error { return fmt.Errorf("outer: %w", err) }
	type c = struct {
		name   string
		err    error
		action consumer.Action
		reason consumer.Outcome
		dup    bool
		dl     bool
		after  time.Duration
	}
	ack, retry, dead := consumer.ActionAck, consumer.ActionRetry, consumer.ActionDeadLetter
	return []c{
		{"nil", nil, ack, "", false, false, 0},
		{"duplicate", &dedup.ClaimError{Err: dedup.ErrDuplicate, Key: key, Result: []byte("r")}, ack, consumer.OutcomeDuplicate, true, false, 0},
		{"duplicate sentinel wrapped", wrap(dedup.ErrDuplicate), ack, consumer.OutcomeDuplicate, true, false, 0},
		{"permanent duplicate", consumer.Permanent(&dedup.ClaimError{Err: dedup.ErrDuplicate, Key: key}), ack, consumer.OutcomeDuplicate, true, false, 0},
		{"dead-lettered", &consumer.DeadLetteredError{Reason: consumer.OutcomePanic, Err: consumer.Permanent(&consumer.PanicError{Value: 1})}, ack, consumer.OutcomePanic, false, true, 0},
		{"dead-lettered wrapped", wrap(&consumer.DeadLetteredError{Reason: consumer.OutcomePermanent, Err: consumer.Permanent(errBoom)}), ack, consumer.OutcomePermanent, false, true, 0},
		{"in flight", inFlight, retry, consumer.OutcomeInFlight, false, false, 3 * time.Second},
		{"in flight wrapped", wrap(inFlight), retry, consumer.OutcomeInFlight, false, false, 3 * time.Second},
		{"in flight sentinel", dedup.ErrInFlight, retry, consumer.OutcomeInFlight, false, false, 0},
		{"permanent in flight", consumer.Permanent(inFlight), retry, consumer.OutcomeInFlight, false, false, 3 * time.Second},
		{"exhausted in flight", &consumer.RetriesExhaustedError{Attempts: 5, Err: inFlight}, retry, consumer.OutcomeInFlight, false, false, 3 * time.Second},
		{"lease lost", wrap(dedup.ErrLeaseLost), retry, consumer.OutcomeLeaseLost, false, false, 0},
		{"permanent lease lost", consumer.Permanent(dedup.ErrLeaseLost), retry, consumer.OutcomeLeaseLost, false, false, 0},
		{"lease lost and permanent handler error", fmt.Errorf("%w; handler: %w", dedup.ErrLeaseLost, consumer.Permanent(errBoom)), retry, consumer.OutcomeLeaseLost, false, false, 0},
		{"mismatch", &dedup.ClaimError{Err: dedup.ErrFingerprintMismatch, Key: key}, dead, consumer.OutcomeFingerprintMismatch, false, false, 0},
		{"mismatch wrapped", wrap(&dedup.ClaimError{Err: dedup.ErrFingerprintMismatch, Key: key}), dead, consumer.OutcomeFingerprintMismatch, false, false, 0},
		{"permanent mismatch", consumer.Permanent(dedup.ErrFingerprintMismatch), dead, consumer.OutcomeFingerprintMismatch, false, false, 0},
		{"invalid key", fmt.Errorf("%w: id is empty", dedup.ErrInvalidKey), dead, consumer.OutcomeInvalidKey, false, false, 0},
		{"permanent", consumer.Permanent(errBoom), dead, consumer.OutcomePermanent, false, false, 0},
		{"permanent wrapped", wrap(consumer.Permanent(errBoom)), dead, consumer.OutcomePermanent, false, false, 0},
		{"panic", consumer.Permanent(&consumer.PanicError{Value: "x"}), dead, consumer.OutcomePanic, false, false, 0},
		{"bare panic", &consumer.PanicError{Value: errBoom}, dead, consumer.OutcomePanic, false, false, 0},
		{"panic of a duplicate error", &consumer.PanicError{Value: dedup.ErrDuplicate}, dead, consumer.OutcomePanic, false, false, 0},
		{"retries exhausted", &consumer.RetriesExhaustedError{Attempts: 3, Err: errBoom}, dead, consumer.OutcomeRetriesExhausted, false, false, 0},
		{"retries exhausted wrapped", wrap(&consumer.RetriesExhaustedError{Attempts: 3, Err: errBoom}), dead, consumer.OutcomeRetriesExhausted, false, false, 0},
		{"retries exhausted on timeouts", &consumer.RetriesExhaustedError{Attempts: 3, Err: &consumer.TimeoutError{Timeout: time.Second, Err: context.DeadlineExceeded}}, dead, consumer.OutcomeRetriesExhausted, false, false, 0},
		{"timeout", &consumer.TimeoutError{Timeout: time.Second, Err: context.DeadlineExceeded}, retry, consumer.OutcomeTimeout, false, false, 0},
		{"timeout of a permanent error", &consumer.TimeoutError{Timeout: time.Second, Err: consumer.Permanent(context.DeadlineExceeded)}, retry, consumer.OutcomeTimeout, false, false, 0},
		{"transient", errBoom, retry, consumer.OutcomeTransient, false, false, 0},
		{"transient wrapped", wrap(errBoom), retry, consumer.OutcomeTransient, false, false, 0},
		{"store closed", wrap(dedup.ErrClosed), retry, consumer.OutcomeTransient, false, false, 0},
		{"canceled", context.Canceled, retry, consumer.OutcomeTransient, false, false, 0},
		{"bare deadline", wrap(context.DeadlineExceeded), retry, consumer.OutcomeTransient, false, false, 0},
		{"joined transient and permanent", errors.Join(errBoom, consumer.Permanent(io.EOF)), dead, consumer.OutcomePermanent, false, false, 0},
	}
}

func TestDecide(t *testing.T) {
	for _, c := range decideCases() {
		t.Run(c.name, func(t *testing.T) {
			r := consumer.Decide(c.err)
			if r.Action != c.action || r.Reason != c.reason || r.Duplicate != c.dup || r.DeadLettered != c.dl || r.RetryAfter != c.after || r.Err != c.err {
				t.Fatalf("Decide(%v) = %+v, want %v/%q dup=%v dl=%v after=%v", c.err, r, c.action, c.reason, c.dup, c.dl, c.after)
			}
		})
	}
}

func TestDecideDeadLetterFailureRetries(t *testing.T) {
	// A DeadLetter whose hook fails yields an error that wraps a permanent
	// cause, yet must be retried.
	dl := mustDeadLetter(t, func(context.Context, *consumer.Message, consumer.Outcome, error) error { return io.ErrClosedPipe })
	err := dl(consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		return consumer.Permanent(errBoom)
	})).Handle(context.Background(), msg("1", "p"))
	wantResult(t, consumer.Decide(err), consumer.ActionRetry, consumer.OutcomeTransient)
	if !errors.Is(err, errBoom) || !errors.Is(err, io.ErrClosedPipe) {
		t.Fatalf("error %v does not wrap both the cause and the hook's error", err)
	}
	if isPermanent(err) {
		t.Fatal("a failed dead-lettering is reported as permanent")
	}
}

func TestProcess(t *testing.T) {
	ctx := context.Background()
	ok := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	wantResult(t, consumer.Process(ctx, ok, msg("1", "")), consumer.ActionAck, "")

	poison := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return consumer.Permanent(errBoom) })
	wantResult(t, consumer.Process(ctx, poison, msg("1", "")), consumer.ActionDeadLetter, consumer.OutcomePermanent)

	// While the consumer stops, nothing is dead-lettered: the error may
	// come from the stop itself.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	r := consumer.Process(cctx, poison, msg("1", ""))
	wantResult(t, r, consumer.ActionRetry, consumer.OutcomeTransient)
	if !errors.Is(r.Err, errBoom) {
		t.Fatalf("Result.Err = %v, want the handler's error", r.Err)
	}
	dup := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return dedup.ErrDuplicate })
	wantResult(t, consumer.Process(cctx, dup, msg("1", "")), consumer.ActionAck, consumer.OutcomeDuplicate)
}

// DecideContext is the stopping rule for an adapter that runs the chain
// itself: Decide while the consumer runs, no dead letter while it stops.
func TestDecideContext(t *testing.T) {
	live := context.Background()
	stopping, cancel := context.WithCancel(live)
	cancel()
	for _, c := range []struct {
		err           error
		live, stopped consumer.Action
	}{
		{nil, consumer.ActionAck, consumer.ActionAck},
		{consumer.Permanent(errBoom), consumer.ActionDeadLetter, consumer.ActionRetry},
		{dedup.ErrInvalidKey, consumer.ActionDeadLetter, consumer.ActionRetry},
		{dedup.ErrDuplicate, consumer.ActionAck, consumer.ActionAck},
		{errBoom, consumer.ActionRetry, consumer.ActionRetry},
	} {
		if got := consumer.DecideContext(live, c.err); got != consumer.Decide(c.err) || got.Action != c.live {
			t.Errorf("DecideContext(live, %v) = %+v, want Decide's, %v", c.err, got, c.live)
		}
		got := consumer.DecideContext(stopping, c.err)
		if got.Action != c.stopped || got.Err != c.err {
			t.Errorf("DecideContext(stopping, %v) = %+v, want %v with the error kept", c.err, got, c.stopped)
		}
		if c.live == consumer.ActionDeadLetter && got.Reason != consumer.OutcomeTransient {
			t.Errorf("DecideContext(stopping, %v).Reason = %q, want transient", c.err, got.Reason)
		}
	}
}

// isPermanent reports whether Decide dead-letters err.
func isPermanent(err error) bool { return consumer.Decide(err).Action == consumer.ActionDeadLetter }
