package adaptertest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
)

// Harness is what a broker adapter implements to run the suite. Its
// methods are called from one test goroutine at a time, except
// DeadLetters, which may be called while a consumer runs.
type Harness interface {
	// Capabilities says what the broker promises and which cases the
	// harness cannot run.
	Capabilities() Capabilities
	// NewDestination creates a destination isolated from every other one
	// (a fresh topic or queue) and its dead-letter destination, so that
	// messages published to it before any consumer starts are kept. opts
	// are the options its consumers will be started with, for a broker
	// whose topology depends on them (a retry queue per delay). Register
	// the cleanup with t.
	NewDestination(t testing.TB, opts ConsumerOptions) Destination
	// Publish sends msgs to d, in order, and returns once the broker holds
	// them. A Message with an empty ID is sent without an id.
	Publish(ctx context.Context, d Destination, msgs ...Message) error
	// Start starts a consumer of d that runs w with opts, and returns once
	// it consumes: a message published after Start returns reaches it.
	// The consumer runs until Consumer.Stop; ctx bounds the start only.
	// In a child process (see the package documentation) d is the value
	// NewDestination returned in the parent, read back from JSON.
	Start(ctx context.Context, d Destination, w Work, opts ConsumerOptions) (Consumer, error)
	// DeadLetters returns every message the consumers of d have sent to
	// its dead-letter destination so far, oldest first, each once as the
	// broker holds it (a dead letter sent twice is two values).
	DeadLetters(ctx context.Context, d Destination) ([]DeadLetter, error)
}

// Consumer is a running consumer started by Harness.Start.
type Consumer interface {
	// Stop stops the consumer gracefully and waits until it has: every
	// delivery it took is settled or given back to the broker.
	Stop(ctx context.Context) error
	// Interrupt makes the consumer lose its connection to the broker (it
	// closes the connection under it, or restarts a broker of the test's
	// own) and returns once the connection is gone; the consumer must
	// reconnect by itself. It returns an error wrapping ErrUnsupported
	// when the harness cannot do that.
	Interrupt(ctx context.Context) error
}

// ErrUnsupported is wrapped by the error of a harness method that cannot
// do what it was asked. The case that asked is skipped, or failed under
// CI, unless Capabilities.Unsupported declares it.
var ErrUnsupported = errors.New("adaptertest: not supported by this harness")

// Capabilities describe a broker and its harness.
type Capabilities struct {
	// Ordering is the order the broker and adapter promise. Defaults to
	// OrderNone.
	Ordering Ordering
	// ChildProcess says that Harness.Start works in a child process of
	// the test (the broker is reachable from another process, and
	// Destination.Params say how). The crash cases need it. Defaults to
	// false: the crash cases then fail under CI unless Unsupported
	// declares CaseAckRule and CaseDeadLetterResent.
	ChildProcess bool
	// Unsupported declares the cases the harness cannot run, each with the
	// reason, which the skipped case prints. Defaults to none.
	Unsupported map[Case]string
	// Parallel says that the cases may run side by side (t.Parallel): each
	// Destination is independent of every other (its own queue, topic or
	// stream), a Consumer's Interrupt cuts only that consumer, and the
	// harness's methods are safe for concurrent use. Defaults to false: the
	// cases run one after another.
	Parallel bool
}

// Ordering is the delivery order a broker and its adapter promise, as far
// as the suite checks it.
type Ordering int

const (
	// OrderNone promises no order: a retried message may come after
	// messages published after it, and messages never wait for one
	// another's retries.
	OrderNone Ordering = iota
	// OrderPerKey promises that messages with the same Key are applied in
	// the order they were published, retries included, while messages of
	// other keys do not wait for them.
	OrderPerKey
	// OrderPerDestination promises that every message of a destination is
	// applied in the order it was published, retries included: a message
	// being retried holds up every message after it.
	OrderPerDestination
)

func (o Ordering) String() string {
	switch o {
	case OrderNone:
		return "none"
	case OrderPerKey:
		return "per key"
	case OrderPerDestination:
		return "per destination"
	}
	return fmt.Sprintf("Ordering(%d)", int(o))
}

// Case names one case of the suite, as its subtest is named.
type Case string

// The cases of the suite; the package documentation says what each checks.
const (
	CaseAckRule          Case = "AckRule"
	CaseDuplicate        Case = "Duplicate"
	CaseTransientRetry   Case = "TransientRetry"
	CaseDeadLetter       Case = "DeadLetter"
	CaseDeadLetterResent Case = "DeadLetterResent"
	CaseOrder            Case = "Order"
	CaseGracefulStop     Case = "GracefulStop"
	CaseReconnect        Case = "Reconnect"
	CaseStoreDown        Case = "StoreDown"
)

// Cases returns every case of the suite, in the order Run runs them.
func Cases() []Case {
	return []Case{CaseAckRule, CaseDuplicate, CaseTransientRetry, CaseDeadLetter, CaseDeadLetterResent,
		CaseOrder, CaseGracefulStop, CaseReconnect, CaseStoreDown}
}

// Destination is one isolated destination made by Harness.NewDestination.
// It is marshalled to JSON to reach a child process.
type Destination struct {
	// Name is the topic, queue or route the messages are published to.
	Name string `json:"name"`
	// DeadLetter is the destination dead letters go to.
	DeadLetter string `json:"dead_letter"`
	// Params hold whatever else reaching the destination takes (broker
	// addresses, the queue type), for the harness itself.
	Params map[string]string `json:"params,omitempty"`
}

// Message is a message the suite publishes.
type Message struct {
	// ID is the producer-assigned message id; empty means none.
	ID string
	// Key is the partition or ordering key; nil means none.
	Key []byte
	// Payload is the body.
	Payload []byte
	// Headers are application headers.
	Headers map[string]string
}

// DeadLetter is a message read back from a dead-letter destination.
type DeadLetter struct {
	// ID is the dead letter's own id, which a reader of the dead-letter
	// destination deduplicates on: the same every time the same delivery
	// is dead-lettered.
	ID string
	// Reason is why the message was dead-lettered, a consumer.Outcome
	// ("permanent", "invalid_key", "fingerprint_mismatch", ...).
	Reason string
	// Attempts is how many times the adapter says the message was tried;
	// 0 when its dead letters do not say.
	Attempts int
	// Payload and Headers are the dead letter's body and headers, as the
	// broker holds them.
	Payload []byte
	Headers map[string]string
}

// ConsumerOptions are the settings the suite asks a consumer for. A harness
// maps them to its adapter's options.
type ConsumerOptions struct {
	// Backoff shapes the delays between the retries of a message that
	// failed with a transient error: Backoff.Initial before the first,
	// growing by Backoff.Factor up to Backoff.Max. A harness passes it to
	// its adapter's Backoff, or maps it to the adapter's own retry
	// settings.
	Backoff consumer.Backoff
	// MaxAttempts is the delivery bound of a message that keeps failing
	// with a transient error, where the adapter has one: after that many
	// attempts it is dead-lettered. The suite sets it above what any case
	// needs.
	MaxAttempts int
}

// Work is what a consumer started by the suite runs.
//
// An adapter that takes a consumer.Handler runs Handler and needs nothing
// else. An adapter whose claim is a middleware of its own (Watermill's)
// builds it from Store and Scope, runs Effect inside the claim's
// transaction with a consumer.Message made from the delivery (ID, Key,
// Payload, Headers), passes OnOutcome to it, and calls AfterCommit once
// the claim's transaction committed, before the delivery is settled.
type Work struct {
	// Handler is consumer.Transactional over Store and Effect, with
	// AfterCommit called after it.
	Handler consumer.Handler
	// Store is the dedup store the messages are claimed in.
	Store *pgtable.Store
	// Scope is the claims' scope.
	Scope string
	// Effect applies a message in the claim's transaction.
	Effect consumer.TxHandler[pgx.Tx]
	// OnOutcome receives the claim's reports.
	OnOutcome func(ctx context.Context, r consumer.Report)
	// AfterCommit is called with each message whose claim committed.
	AfterCommit func(msg *consumer.Message)
}

// Run runs the conformance suite against h, one subtest per case.
func Run(t *testing.T, h Harness) {
	t.Helper()
	if h == nil {
		t.Fatal("adaptertest: Run: the harness is nil")
	}
	if spec, ok := childSpecFor(t); ok {
		os.Exit(runChild(h, spec))
	}
	s := &suite{h: h, caps: h.Capabilities(), name: t.Name()}
	for c := range s.caps.Unsupported {
		if s.caps.Unsupported[c] == "" {
			t.Fatalf("adaptertest: Capabilities.Unsupported[%s] has no reason; say why the harness cannot run it", c)
		}
		if !knownCase(c) {
			t.Fatalf("adaptertest: Capabilities.Unsupported names %q, which is not a case (see Cases)", c)
		}
	}
	cases := map[Case]func(*testing.T){
		CaseAckRule:          s.ackRule,
		CaseDuplicate:        s.duplicate,
		CaseTransientRetry:   s.transientRetry,
		CaseDeadLetter:       s.deadLetter,
		CaseDeadLetterResent: s.deadLetterResent,
		CaseOrder:            s.order,
		CaseGracefulStop:     s.gracefulStop,
		CaseReconnect:        s.reconnect,
		CaseStoreDown:        s.storeDown,
	}
	for _, c := range Cases() {
		t.Run(string(c), func(t *testing.T) {
			if s.caps.Parallel {
				t.Parallel()
			}
			if reason, ok := s.caps.Unsupported[c]; ok {
				t.Skipf("declared unsupported by the harness: %s", reason)
			}
			cases[c](t)
		})
	}
}

func knownCase(c Case) bool {
	for _, k := range Cases() {
		if k == c {
			return true
		}
	}
	return false
}

type suite struct {
	h    Harness
	caps Capabilities
	name string // the test that called Run
}

// required reports whether a check that cannot run fails the test.
func required() bool {
	return os.Getenv("CI") == "true" || os.Getenv("IDEM_REQUIRE_SERVICES") == "1"
}

// cannot ends a case that could not run: skipped locally, failed under CI.
func cannot(t testing.TB, msg string) {
	t.Helper()
	if required() {
		t.Fatalf("%s; the case did not run, and CI=true or IDEM_REQUIRE_SERVICES=1 makes that a failure (declare it in Capabilities.Unsupported if the adapter cannot do it)", msg)
	}
	t.Skip(msg + " (the case did not run; under CI this fails)")
}

// options are the consumer options every case uses.
func options() ConsumerOptions {
	return ConsumerOptions{Backoff: consumer.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond, Factor: 2}, MaxAttempts: 100}
}

// testCtx bounds one step of a case.
func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// eventually polls cond until it holds, failing the test after limit. The
// limit bounds a broken adapter's hang; it measures nothing.
func eventually(t testing.TB, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up after %v waiting for %s", limit, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// start starts a consumer of d and stops it when the test ends.
func (s *suite) start(t testing.TB, d Destination, w Work) Consumer {
	t.Helper()
	c, err := s.h.Start(testCtx(t), d, w, options())
	if err != nil {
		t.Fatalf("Harness.Start: %v", err)
	}
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			if err := c.Stop(context.Background()); err != nil {
				t.Errorf("Consumer.Stop: %v", err)
			}
		}
	})
	return &stopOnce{Consumer: c, stopped: &stopped}
}

type stopOnce struct {
	Consumer
	stopped *bool
}

func (c *stopOnce) Stop(ctx context.Context) error {
	if *c.stopped {
		return nil
	}
	*c.stopped = true
	return c.Consumer.Stop(ctx)
}

func (s *suite) publish(t testing.TB, d Destination, msgs ...Message) {
	t.Helper()
	if err := s.h.Publish(testCtx(t), d, msgs...); err != nil {
		t.Fatalf("Harness.Publish: %v", err)
	}
}

func (s *suite) deadLetters(t testing.TB, d Destination) []DeadLetter {
	t.Helper()
	dls, err := s.h.DeadLetters(testCtx(t), d)
	if err != nil {
		t.Fatalf("Harness.DeadLetters: %v", err)
	}
	return dls
}

// msgs returns n messages with ids prefix-000 ... and JSON payloads, keyed
// by key (nil for none).
func msgs(prefix string, n int, key []byte) []Message {
	out := make([]Message, n)
	for i := range out {
		id := fmt.Sprintf("%s-%03d", prefix, i)
		out[i] = msg(id, key)
	}
	return out
}

func msg(id string, key []byte) Message {
	return Message{ID: id, Key: key, Payload: []byte(fmt.Sprintf(`{"id":%q}`, id)), Headers: map[string]string{"x-adaptertest": "1"}}
}

func ids(ms []Message) []string {
	out := make([]string, len(ms))
	for i, m := range ms {
		out[i] = m.ID
	}
	return out
}

func short(s string) string {
	if len(s) > 40 {
		return s[:20] + "..." + s[len(s)-10:]
	}
	return strings.ToValidUTF8(s, "?")
}
