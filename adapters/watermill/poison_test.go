package idemwatermill_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestPoisonQueueOption: with Options.PoisonQueue, a forged message (a known
// UUID with other content) and a message without its id go to Watermill's
// poison queue with idem's reason in the metadata, are acknowledged, and never
// reach the handler; the original is applied once.
func TestPoisonQueueOption(t *testing.T) {
	t.Parallel()
	for _, k := range allKinds() {
		t.Run(k.name, func(t *testing.T) {
			fx := k.setup(t)
			poisonPub := &recordingPublisher{}
			pq := must(middleware.PoisonQueue(poisonPub, "poison"))
			ps := newGoChannel(t)
			r := newRouter(t)
			r.AddMiddleware(fx.middleware(t, idemwatermill.Options{KeyMetadata: "event_id", PoisonQueue: pq}))
			var runs atomic.Int32
			topic := testenv.Name("payments")
			r.AddConsumerHandler("charge", topic, ps, func(msg *message.Message) error {
				runs.Add(1)
				return fx.oracle.record(msg, "charge")
			})
			startRouter(t, r)

			orig := message.NewMessage(wm.NewUUID(), []byte(`{"amount":100}`))
			orig.Metadata.Set("event_id", "evt-1")
			forged := message.NewMessage(orig.UUID, []byte(`{"amount":900}`))
			forged.Metadata.Set("event_id", "evt-1")
			noID := message.NewMessage(wm.NewUUID(), []byte(`{"amount":5}`))
			for _, m := range []*message.Message{orig, forged, noID} {
				if err := ps.Publish(topic, m); err != nil {
					t.Fatal(err)
				}
			}

			if n := runs.Load(); n != 1 {
				t.Errorf("handler ran %d times, want 1 (the original only)", n)
			}
			topics, got := poisonPub.published()
			if len(got) != 2 {
				t.Fatalf("poison queue got %d messages, want 2", len(got))
			}
			for i, want := range []struct {
				uuid, reason, cause string
			}{
				{forged.UUID, string(consumer.OutcomeFingerprintMismatch), "fingerprint mismatch"},
				{noID.UUID, string(consumer.OutcomeInvalidKey), `metadata "event_id"`},
			} {
				m := got[i]
				if topics[i] != "poison" || m.UUID != want.uuid {
					t.Errorf("poison #%d: topic %s uuid %s", i, topics[i], m.UUID)
				}
				if m.Metadata.Get(consumer.HeaderReason) != want.reason {
					t.Errorf("poison #%d: %s = %q, want %q", i, consumer.HeaderReason, m.Metadata.Get(consumer.HeaderReason), want.reason)
				}
				if r := m.Metadata.Get(middleware.ReasonForPoisonedKey); !strings.Contains(r, want.cause) {
					t.Errorf("poison #%d: %s = %q, want it to mention %q", i, middleware.ReasonForPoisonedKey, r, want.cause)
				}
				if m.Metadata.Get(middleware.PoisonedHandlerKey) != "charge" {
					t.Errorf("poison #%d: handler %q", i, m.Metadata.Get(middleware.PoisonedHandlerKey))
				}
			}
		})
	}
}

// TestPoisonWithoutQueue: without Options.PoisonQueue, poison is returned as
// a permanent *PoisonError with the reason in the metadata; the handler does
// not run.
func TestPoisonWithoutQueue(t *testing.T) {
	t.Parallel()
	mw := must(idemwatermill.Dedup(newMemstore(t), idemwatermill.Options{Scope: "billing/charge"}))
	var runs atomic.Int32
	h := mw(func(*message.Message) ([]*message.Message, error) { runs.Add(1); return nil, nil })

	orig := message.NewMessage(wm.NewUUID(), []byte("a"))
	if _, err := h(orig); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name   string
		msg    *message.Message
		reason consumer.Outcome
		is     error
	}{
		{"fingerprint_mismatch", message.NewMessage(orig.UUID, []byte("b")), consumer.OutcomeFingerprintMismatch, dedup.ErrFingerprintMismatch},
		{"empty_uuid", message.NewMessage("", []byte("c")), consumer.OutcomeInvalidKey, dedup.ErrInvalidKey},
		{"control_byte", message.NewMessage("id\n2", []byte("d")), consumer.OutcomeInvalidKey, dedup.ErrInvalidKey},
		{"too_long", message.NewMessage(strings.Repeat("x", 256), []byte("e")), consumer.OutcomeInvalidKey, dedup.ErrInvalidKey},
		{"nil_metadata", &message.Message{UUID: "", Payload: []byte("f")}, consumer.OutcomeInvalidKey, dedup.ErrInvalidKey},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := h(c.msg)
			var pe *idemwatermill.PoisonError
			if !errors.As(err, &pe) || pe.Reason != c.reason || !errors.Is(err, c.is) {
				t.Fatalf("err = %v, want a *PoisonError (%s) wrapping %v", err, c.reason, c.is)
			}
			if !idemwatermill.IsPoison(err) || idemwatermill.Retryable(err) || consumer.Decide(err).Action != consumer.ActionDeadLetter {
				t.Errorf("IsPoison %v, Retryable %v, dead-lettered %v", idemwatermill.IsPoison(err), idemwatermill.Retryable(err), consumer.Decide(err).Action == consumer.ActionDeadLetter)
			}
			if got := c.msg.Metadata.Get(consumer.HeaderReason); got != string(c.reason) {
				t.Errorf("metadata %s = %q, want %q", consumer.HeaderReason, got, c.reason)
			}
			if got := c.msg.Metadata.Get(consumer.HeaderError); !strings.Contains(got, c.is.Error()) {
				t.Errorf("metadata %s = %q, want the error (%v)", consumer.HeaderError, got, c.is)
			}
			if got, ok := c.msg.Metadata[consumer.HeaderID]; !ok || got != c.msg.UUID {
				t.Errorf("metadata %s = %q (present %v), want the UUID %q", consumer.HeaderID, got, ok, c.msg.UUID)
			}
		})
	}
	if runs.Load() != 1 {
		t.Errorf("handler ran %d times, want 1", runs.Load())
	}
}

// TestPoisonQueueWithFilterOutside: the other wiring, without the option —
// Watermill's PoisonQueueWithFilter(IsPoison) outermost and Retry with
// ShouldRetry = Retryable: poison skips the retries and lands in the poison
// queue; a transient handler error is retried and never poisoned.
func TestPoisonQueueWithFilterOutside(t *testing.T) {
	t.Parallel()
	poisonPub := &recordingPublisher{}
	pq := must(middleware.PoisonQueueWithFilter(poisonPub, "poison", idemwatermill.IsPoison))
	var retried, notRetried atomic.Int32
	retry := fastRetry(5)
	retry.ShouldRetry = func(p middleware.RetryParams) bool {
		ok := idemwatermill.Retryable(p.Err)
		if ok {
			retried.Add(1)
		} else {
			notRetried.Add(1)
		}
		return ok
	}

	ps := newGoChannel(t)
	r := newRouter(t)
	r.AddMiddleware(pq, retry.Middleware, must(idemwatermill.Dedup(newMemstore(t), idemwatermill.Options{})))
	var runs atomic.Int32
	topic := testenv.Name("payments")
	r.AddConsumerHandler("charge", topic, ps, func(msg *message.Message) error {
		if runs.Add(1) == 2 {
			return errGateway // the second message fails once
		}
		return nil
	})
	startRouter(t, r)

	a := message.NewMessage(wm.NewUUID(), []byte("a"))
	b := message.NewMessage(wm.NewUUID(), []byte("b"))
	forged := message.NewMessage(a.UUID, []byte("forged"))
	for _, m := range []*message.Message{a, b, forged} {
		if err := ps.Publish(topic, m); err != nil {
			t.Fatal(err)
		}
	}
	if runs.Load() != 3 {
		t.Errorf("handler ran %d times, want 3 (a, b failing, b again)", runs.Load())
	}
	_, got := poisonPub.published()
	if len(got) != 1 || got[0].UUID != forged.UUID || got[0].Metadata.Get(consumer.HeaderReason) != string(consumer.OutcomeFingerprintMismatch) {
		t.Fatalf("poison queue got %v", got)
	}
	if retried.Load() != 1 || notRetried.Load() != 1 {
		t.Errorf("Retry retried %d errors and gave up on %d; want 1 (the gateway timeout) and 1 (the forged message)", retried.Load(), notRetried.Load())
	}
}

// TestKeyFunc: KeyFunc picks the id; its error is retried unless it says the
// key is invalid or permanent.
func TestKeyFunc(t *testing.T) {
	t.Parallel()
	store := newMemstore(t)
	var keyErr error
	mw := must(idemwatermill.Dedup(store, idemwatermill.Options{Scope: "s", KeyFunc: func(m *message.Message) (string, error) {
		return "order-" + string(m.Payload), keyErr
	}}))
	var runs atomic.Int32
	h := mw(func(*message.Message) ([]*message.Message, error) { runs.Add(1); return nil, nil })
	for i := range 2 { // two UUIDs, one key: the second is a duplicate
		if _, err := h(message.NewMessage(fmt.Sprint(i), []byte("7"))); err != nil {
			t.Fatal(err)
		}
	}
	if runs.Load() != 1 {
		t.Fatalf("runs = %d", runs.Load())
	}
	keyErr = errors.New("schema registry unreachable")
	if _, err := h(message.NewMessage("x", []byte("8"))); err == nil || idemwatermill.IsPoison(err) || !idemwatermill.Retryable(err) {
		t.Errorf("transient key error: %v", err)
	}
	for _, e := range []error{fmt.Errorf("no order id: %w", dedup.ErrInvalidKey), consumer.Permanent(errors.New("undecodable"))} {
		keyErr = e
		if _, err := h(message.NewMessage("x", []byte("9"))); !idemwatermill.IsPoison(err) {
			t.Errorf("key error %v: got %v, want poison", e, err)
		}
	}
}

// TestScopeFromHandlerName: outside a router, with no Options.Scope, there
// is no scope: a configuration error, retried (never poison).
func TestScopeFromHandlerName(t *testing.T) {
	t.Parallel()
	mw := must(idemwatermill.Dedup(newMemstore(t), idemwatermill.Options{}))
	_, err := mw(func(*message.Message) ([]*message.Message, error) { return nil, nil })(message.NewMessage("a", nil))
	if err == nil || idemwatermill.IsPoison(err) || !strings.Contains(err.Error(), "Options.Scope") {
		t.Fatalf("err = %v", err)
	}
}

// TestOnOutcomeAfterPoisonQueue: OnOutcome reports a poison message once,
// after the poison queue took it (published to a real pub/sub, whose
// subscriber received it); when the poison queue cannot publish, the
// report's error says so next to the poison error.
func TestOnOutcomeAfterPoisonQueue(t *testing.T) {
	t.Parallel()
	for _, k := range allKinds() {
		t.Run(k.name, func(t *testing.T) {
			fx := k.setup(t)
			var (
				mu     sync.Mutex
				events []string
				errs   = map[string]error{}
			)
			event := func(e string) {
				mu.Lock()
				defer mu.Unlock()
				events = append(events, e)
			}
			onOutcome := func(_ context.Context, r consumer.Report) {
				event("report " + string(r.Outcome))
				mu.Lock()
				defer mu.Unlock()
				errs[string(r.Outcome)] = r.Err
			}

			poisonPS := newGoChannel(t)
			poisonTopic := testenv.Name("poison")
			poisoned, err := poisonPS.Subscribe(context.Background(), poisonTopic)
			if err != nil {
				t.Fatal(err)
			}
			subDone := make(chan struct{})
			go func() {
				defer close(subDone)
				for m := range poisoned {
					event("poisoned " + m.Metadata.Get(consumer.HeaderReason))
					m.Ack()
				}
			}()
			pq := must(middleware.PoisonQueue(poisonPS, poisonTopic))

			ps := newGoChannel(t)
			r := newRouter(t)
			r.AddMiddleware(fx.middleware(t, idemwatermill.Options{KeyMetadata: "event_id", PoisonQueue: pq, Telemetry: consumer.Telemetry{OnOutcome: onOutcome}}))
			topic := testenv.Name("payments")
			r.AddConsumerHandler("charge", topic, ps, func(msg *message.Message) error {
				return fx.oracle.record(msg, "charge")
			})
			startRouter(t, r)

			orig := message.NewMessage(wm.NewUUID(), []byte(`{"amount":100}`))
			orig.Metadata.Set("event_id", "evt-1")
			forged := message.NewMessage(wm.NewUUID(), []byte(`{"amount":900}`))
			forged.Metadata.Set("event_id", "evt-1")
			for _, m := range []*message.Message{orig, forged} {
				if err := ps.Publish(topic, m); err != nil {
					t.Fatal(err)
				}
			}
			mu.Lock()
			got := strings.Join(events, ", ")
			mu.Unlock()
			if want := "report completed, poisoned fingerprint_mismatch, report fingerprint_mismatch"; got != want {
				t.Fatalf("events %q, want %q", got, want)
			}

			// A poison queue that cannot publish: the same middleware
			// on the same store, outside the router, after the poison
			// pub/sub closed.
			if err := poisonPS.Close(); err != nil {
				t.Fatal(err)
			}
			<-subDone
			mw := fx.middleware(t, idemwatermill.Options{Scope: "charge", KeyMetadata: "event_id", PoisonQueue: pq, Telemetry: consumer.Telemetry{OnOutcome: onOutcome}})
			again := message.NewMessage(wm.NewUUID(), []byte(`{"amount":901}`))
			again.Metadata.Set("event_id", "evt-1")
			_, herr := mw(func(*message.Message) ([]*message.Message, error) {
				t.Error("the handler ran for a forged message")
				return nil, nil
			})(again)
			if herr == nil {
				t.Fatal("the poison queue could not publish, yet the middleware returned no error")
			}
			mu.Lock()
			defer mu.Unlock()
			if n := len(events); n != 4 || events[3] != "report fingerprint_mismatch" {
				t.Fatalf("events %q, want one more report fingerprint_mismatch", events)
			}
			rerr := errs[string(consumer.OutcomeFingerprintMismatch)]
			if !errors.Is(rerr, dedup.ErrFingerprintMismatch) || !strings.Contains(fmt.Sprint(rerr), "poison queue") {
				t.Errorf("report error %v, want the fingerprint mismatch and the poison queue's failure", rerr)
			}
		})
	}
}
