package idemwatermill_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
)

type outcomeLog struct {
	mu   sync.Mutex
	seen []string
}

func (l *outcomeLog) add(_ context.Context, r consumer.Report) {
	o := string(r.Outcome)
	l.mu.Lock()
	l.seen = append(l.seen, o)
	l.mu.Unlock()
}

func (l *outcomeLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.seen, ",")
}

// TestDedupOutcomes walks a key through the lease middleware's answers:
// success, duplicate, failure (released, runs again), in flight elsewhere.
func TestDedupOutcomes(t *testing.T) {
	t.Parallel()
	store := newMemstore(t)
	var log outcomeLog
	mw := must(idemwatermill.Dedup(store, idemwatermill.Options{Scope: "billing/charge", Telemetry: consumer.Telemetry{OnOutcome: log.add}}))
	var fail atomic.Bool
	var runs atomic.Int32
	produced := message.NewMessage(wm.NewUUID(), []byte("receipt"))
	h := mw(func(*message.Message) ([]*message.Message, error) {
		runs.Add(1)
		if fail.Load() {
			return nil, errGateway
		}
		return []*message.Message{produced}, nil
	})

	msg := message.NewMessage(wm.NewUUID(), []byte("a"))
	orig := msg.Context()
	out, err := h(msg)
	if err != nil || len(out) != 1 || out[0] != produced {
		t.Fatalf("first: %v, %v", out, err)
	}
	if msg.Context() != orig {
		t.Error("the message kept the middleware's context")
	}
	if out, err := h(msg.Copy()); err != nil || out != nil {
		t.Fatalf("duplicate: %v, %v; want nil, nil", out, err)
	}

	fail.Store(true)
	m2 := message.NewMessage(wm.NewUUID(), []byte("b"))
	if _, err := h(m2); err != errGateway { // unchanged, not even wrapped
		t.Fatalf("failed handler: err = %v, want the handler's own error", err)
	}
	fail.Store(false)
	if _, err := h(m2); err != nil {
		t.Fatalf("retry after a failure: %v", err)
	}

	m3 := message.NewMessage(wm.NewUUID(), []byte("c"))
	lease, err := store.Claim(context.Background(), dedup.NewKey("billing/charge", m3.UUID, m3.Payload))
	if err != nil {
		t.Fatal(err)
	}
	_, err = h(m3)
	var ce *dedup.ClaimError
	if !errors.Is(err, dedup.ErrInFlight) || !errors.As(err, &ce) || ce.RetryAfter <= 0 || !idemwatermill.Retryable(err) {
		t.Fatalf("in flight: %v", err)
	}
	if err := store.Release(context.Background(), lease); err != nil {
		t.Fatal(err)
	}
	if runs.Load() != 3 {
		t.Errorf("handler ran %d times, want 3", runs.Load())
	}
	want := "completed,duplicate,released,completed,in_flight"
	if got := log.String(); got != want {
		t.Errorf("outcomes %s, want %s", got, want)
	}
}

// TestDedupHeartbeat: the lease is extended while the handler runs. The
// handler waits until it saw three extensions; no clock is asserted.
func TestDedupHeartbeat(t *testing.T) {
	t.Parallel()
	extended := make(chan struct{}, 100)
	store := &leaseStore{LeaseStore: newMemstore(t), extend: func(context.Context, *dedup.Lease) error {
		extended <- struct{}{}
		return nil
	}}
	mw := must(idemwatermill.Dedup(store, idemwatermill.Options{Scope: "s", ExtendEvery: 2 * time.Millisecond}))
	h := mw(func(*message.Message) ([]*message.Message, error) {
		for range 3 {
			<-extended
		}
		return nil, nil
	})
	msg := message.NewMessage(wm.NewUUID(), []byte("a"))
	if _, err := h(msg); err != nil {
		t.Fatal(err)
	}
	if _, err := store.Claim(context.Background(), dedup.NewKey("s", msg.UUID, msg.Payload)); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("after success the key is %v, want completed", err)
	}
}

// TestDedupLeaseLost: when the store says the lease is gone, the handler's
// context is cancelled with dedup.ErrLeaseLost as its cause, and the message
// is retried (an error wrapping ErrLeaseLost), never completed.
func TestDedupLeaseLost(t *testing.T) {
	t.Parallel()
	var completes atomic.Int32
	store := &leaseStore{
		LeaseStore: newMemstore(t),
		extend: func(context.Context, *dedup.Lease) error {
			return dedup.ErrLeaseLost
		},
		complete: func(context.Context, *dedup.Lease) error { completes.Add(1); return nil },
	}
	var log outcomeLog
	mw := must(idemwatermill.Dedup(store, idemwatermill.Options{Scope: "s", ExtendEvery: time.Millisecond, Telemetry: consumer.Telemetry{OnOutcome: log.add}}))
	var cause error
	h := mw(func(m *message.Message) ([]*message.Message, error) {
		<-m.Context().Done()
		cause = context.Cause(m.Context())
		return nil, nil
	})
	_, err := h(message.NewMessage(wm.NewUUID(), []byte("a")))
	if !errors.Is(cause, dedup.ErrLeaseLost) {
		t.Errorf("handler context cause = %v", cause)
	}
	if !errors.Is(err, dedup.ErrLeaseLost) || !idemwatermill.Retryable(err) {
		t.Errorf("err = %v, want a retryable lease-lost error", err)
	}
	if completes.Load() != 0 || log.String() != string(consumer.OutcomeLeaseLost) {
		t.Errorf("completes %d, outcomes %s", completes.Load(), log.String())
	}
}

// TestDedupLeaseLostPolled: a handler that never waits on Done but polls
// Err (the handler's context makes its cancel context only on demand) also
// sees the lease loss, with dedup.ErrLeaseLost as the cause.
func TestDedupLeaseLostPolled(t *testing.T) {
	t.Parallel()
	store := &leaseStore{LeaseStore: newMemstore(t), extend: func(context.Context, *dedup.Lease) error {
		return dedup.ErrLeaseLost
	}}
	mw := must(idemwatermill.Dedup(store, idemwatermill.Options{Scope: "s", ExtendEvery: time.Millisecond}))
	var herr, cause error
	h := mw(func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		select {
		case <-ctx.Done():
		case <-time.After(10 * time.Second):
		}
		herr, cause = ctx.Err(), context.Cause(ctx)
		return nil, nil
	})
	_, err := h(message.NewMessage(wm.NewUUID(), []byte("a")))
	if !errors.Is(herr, context.Canceled) || !errors.Is(cause, dedup.ErrLeaseLost) {
		t.Errorf("handler context: Err %v, cause %v; want canceled by the lease loss", herr, cause)
	}
	if !errors.Is(err, dedup.ErrLeaseLost) {
		t.Errorf("err = %v, want a lease-lost error", err)
	}
}

// TestDedupHandlerContextEnds: the handler's context, and any context
// derived from it, is cancelled once the middleware returned (like a
// context.WithCancel whose cancel function is deferred), and it carries the
// message context's values and deadline meanwhile.
func TestDedupHandlerContextEnds(t *testing.T) {
	t.Parallel()
	for _, derive := range []bool{false, true} {
		mw := must(idemwatermill.Dedup(newMemstore(t), idemwatermill.Options{Scope: "s"}))
		ctx, cancel := context.WithTimeout(context.WithValue(context.Background(), ctxKey{}, "v"), time.Hour)
		t.Cleanup(cancel) // the message's context stays live: only the middleware cancels
		wantDeadline, _ := ctx.Deadline()
		var kept, child context.Context
		var during error
		_, err := mw(func(m *message.Message) ([]*message.Message, error) {
			kept = m.Context()
			if derive {
				var stop context.CancelFunc
				child, stop = context.WithCancel(kept)
				t.Cleanup(stop)
			}
			during = kept.Err()
			if kept.Value(ctxKey{}) != "v" {
				t.Errorf("value %v", kept.Value(ctxKey{}))
			}
			if d, ok := kept.Deadline(); !ok || !d.Equal(wantDeadline) {
				t.Errorf("deadline %v %v, want %v", d, ok, wantDeadline)
			}
			return nil, nil
		})(message.NewMessageWithContext(ctx, wm.NewUUID(), []byte("a")))
		if err != nil || during != nil {
			t.Fatalf("derive %v: err %v, context while the handler ran: %v", derive, err, during)
		}
		if !errors.Is(kept.Err(), context.Canceled) || !errors.Is(context.Cause(kept), context.Canceled) {
			t.Errorf("derive %v: after the middleware returned: Err %v, Cause %v", derive, kept.Err(), context.Cause(kept))
		}
		select {
		case <-kept.Done():
		default:
			t.Errorf("derive %v: Done not closed after the middleware returned", derive)
		}
		if derive {
			if child.Err() == nil {
				t.Error("a context derived in the handler is not cancelled")
			}
		}
	}
}

// TestDedupPanicReleases: a panicking handler's key is released and the
// panic goes on; the redelivery runs the handler.
func TestDedupPanicReleases(t *testing.T) {
	t.Parallel()
	mw := must(idemwatermill.Dedup(newMemstore(t), idemwatermill.Options{Scope: "s"}))
	var runs atomic.Int32
	h := mw(func(*message.Message) ([]*message.Message, error) {
		if runs.Add(1) == 1 {
			panic("boom")
		}
		return nil, nil
	})
	msg := message.NewMessage(wm.NewUUID(), []byte("a"))
	orig := msg.Context()
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Errorf("recovered %v, want the handler's panic", r)
			}
		}()
		_, _ = h(msg)
	}()
	if msg.Context() != orig {
		t.Error("the message kept the middleware's context after the panic")
	}
	if _, err := h(msg); err != nil || runs.Load() != 2 {
		t.Fatalf("redelivery: err %v, runs %d", err, runs.Load())
	}
}

// TestDedupStoreFailures: a store that cannot claim lets nothing through
// (fail closed, retried); a store that cannot complete gets the message
// retried.
func TestDedupStoreFailures(t *testing.T) {
	t.Parallel()
	down := errors.New("dial tcp 127.0.0.1:6379: connection refused")
	var runs atomic.Int32
	next := func(*message.Message) ([]*message.Message, error) { runs.Add(1); return nil, nil }

	claimFails := &leaseStore{LeaseStore: newMemstore(t), claim: func(context.Context, dedup.Key) (*dedup.Lease, error) { return nil, down }}
	_, err := must(idemwatermill.Dedup(claimFails, idemwatermill.Options{Scope: "s"}))(next)(message.NewMessage("a", nil))
	if !errors.Is(err, down) || !idemwatermill.Retryable(err) || runs.Load() != 0 {
		t.Errorf("claim fails: err %v, runs %d", err, runs.Load())
	}

	noLease := &leaseStore{LeaseStore: newMemstore(t), claim: func(context.Context, dedup.Key) (*dedup.Lease, error) { return nil, nil }}
	if _, err := must(idemwatermill.Dedup(noLease, idemwatermill.Options{Scope: "s"}))(next)(message.NewMessage("a", nil)); err == nil || runs.Load() != 0 {
		t.Errorf("no lease, no error: err %v, runs %d", err, runs.Load())
	}

	completeFails := &leaseStore{LeaseStore: newMemstore(t), complete: func(context.Context, *dedup.Lease) error { return down }}
	_, err = must(idemwatermill.Dedup(completeFails, idemwatermill.Options{Scope: "s"}))(next)(message.NewMessage("a", nil))
	if !errors.Is(err, down) || !idemwatermill.Retryable(err) || runs.Load() != 1 {
		t.Errorf("complete fails: err %v, runs %d", err, runs.Load())
	}
}

// TestFingerprintOption: a custom fingerprint decides what a conflict is;
// the zero fingerprint turns the check off.
func TestFingerprintOption(t *testing.T) {
	t.Parallel()
	mw := must(idemwatermill.Dedup(newMemstore(t), idemwatermill.Options{Scope: "s", Fingerprint: func(*message.Message) dedup.Fingerprint { return dedup.Fingerprint{} }}))
	var runs atomic.Int32
	h := mw(func(*message.Message) ([]*message.Message, error) { runs.Add(1); return nil, nil })
	id := wm.NewUUID()
	for _, p := range []string{"a", "b"} {
		if out, err := h(message.NewMessage(id, []byte(p))); err != nil || out != nil {
			t.Fatalf("%s: %v, %v", p, out, err)
		}
	}
	if runs.Load() != 1 {
		t.Fatalf("runs %d", runs.Load())
	}
}

// noTxStore is a dedup.TxStore that is never called.
type noTxStore struct{}

func (noTxStore) Process(context.Context, dedup.Key, dedup.TxFunc[pgx.Tx]) ([]byte, error) {
	return nil, errors.New("not implemented")
}

// TestOptionsValidation: constructors refuse bad options with a hint.
func TestOptionsValidation(t *testing.T) {
	t.Parallel()
	store := newMemstore(t)
	cases := []struct {
		name string
		err  func() error
		hint string
	}{
		{"nil lease store", func() error { _, err := idemwatermill.Dedup(nil, idemwatermill.Options{}); return err }, "memstore.New"},
		{"outbox on lease", func() error {
			_, err := idemwatermill.Dedup(store, idemwatermill.Options{OutboxTopic: "x"})
			return err
		}, "Transactional"},
		{"negative MaxKeyLen", func() error { _, err := idemwatermill.Dedup(store, idemwatermill.Options{MaxKeyLen: -1}); return err }, "MaxKeyLen"},
		{"bad scope", func() error { _, err := idemwatermill.Dedup(store, idemwatermill.Options{Scope: "a\x00b"}); return err }, "Scope"},
		{"negative FinishTimeout", func() error {
			_, err := idemwatermill.Dedup(store, idemwatermill.Options{FinishTimeout: -time.Second})
			return err
		}, "FinishTimeout"},
		{"nil tx store", func() error { _, err := idemwatermill.Transactional[pgx.Tx](nil, idemwatermill.Options{}); return err }, "*pgtable.Store"},
		{"outbox topic without outbox", func() error {
			_, err := idemwatermill.Transactional(noTxStore{}, idemwatermill.Options{OutboxTopic: "x"})
			return err
		}, "need Options.Outbox"},
		{"nil publisher", func() error { _, err := idemwatermill.NewPublisher(nil); return err }, "pub is nil"},
	}
	for _, c := range cases {
		if err := c.err(); err == nil || !strings.Contains(err.Error(), c.hint) {
			t.Errorf("%s: err = %v, want a hint with %q", c.name, err, c.hint)
		}
	}
}

// TestDedupFinishContext: Complete runs detached from the message's
// cancellation — a handler that succeeds while the router stops still gets
// its key completed — but bounded by FinishTimeout.
func TestDedupFinishContext(t *testing.T) {
	t.Parallel()
	t.Run("detached", func(t *testing.T) {
		mem := newMemstore(t)
		var completeErr error
		store := &leaseStore{LeaseStore: mem, complete: func(ctx context.Context, _ *dedup.Lease) error {
			completeErr = ctx.Err()
			return nil
		}}
		mw := must(idemwatermill.Dedup(store, idemwatermill.Options{Scope: "s"}))
		ctx, cancel := context.WithCancel(context.WithValue(context.Background(), ctxKey{}, "v"))
		msg := message.NewMessageWithContext(ctx, wm.NewUUID(), []byte("a"))
		var seen any
		_, err := mw(func(m *message.Message) ([]*message.Message, error) {
			seen = m.Context().Value(ctxKey{})
			cancel() // the router stops while the handler finishes
			return nil, nil
		})(msg)
		if err != nil || completeErr != nil {
			t.Fatalf("err %v, Complete's context: %v", err, completeErr)
		}
		if seen != "v" {
			t.Errorf("the handler's context lost the message context's values: %v", seen)
		}
		if _, err := mem.Claim(context.Background(), dedup.NewKey("s", msg.UUID, msg.Payload)); !errors.Is(err, dedup.ErrDuplicate) {
			t.Errorf("key after success: %v", err)
		}
	})
	t.Run("bounded", func(t *testing.T) {
		store := &leaseStore{LeaseStore: newMemstore(t), complete: func(ctx context.Context, _ *dedup.Lease) error {
			<-ctx.Done() // a store that hangs
			return ctx.Err()
		}}
		mw := must(idemwatermill.Dedup(store, idemwatermill.Options{Scope: "s", FinishTimeout: 10 * time.Millisecond}))
		_, err := mw(func(*message.Message) ([]*message.Message, error) { return nil, nil })(message.NewMessage(wm.NewUUID(), []byte("a")))
		if !errors.Is(err, context.DeadlineExceeded) || !idemwatermill.Retryable(err) {
			t.Fatalf("err = %v, want a retryable deadline error", err)
		}
	})
}

type ctxKey struct{}
