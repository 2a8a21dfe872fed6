package idemnats

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/effectstest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// Every message published, and every copy re-published after the stream's
// duplicate window, is applied exactly once under consumer.Transactional;
// the copies are acknowledged as duplicates.
func TestConsumerTransactionalDuplicates(t *testing.T) {
	t.Parallel()
	_, js := testenv.NATS(t)
	s := newStream(t, js, 100*time.Millisecond)
	o := effectstest.New(t, 8)
	ids := s.publishN(t, "m", 200)
	time.Sleep(150 * time.Millisecond) // past the duplicate window
	copies := 0
	for _, id := range ids[:100] {
		if ack := s.publish(t, id, []byte("p-"+id), nil); !ack.Duplicate {
			copies++
		}
	}
	if copies == 0 {
		t.Fatal("the stream dropped every copy: the duplicate window did not elapse")
	}
	c, err := NewConsumer(js, s.name, "work", o.Handler(t, nil), ConsumerOptions{Concurrency: 4, Telemetry: consumer.Telemetry{Logger: quiet()}, Backoff: testBackoff})
	if err != nil {
		t.Fatal(err)
	}
	stop := runConsumer(t, c)
	testenv.Eventually(t, 60*time.Second, "every message settled", func() bool {
		return c.Stats().Acked == int64(len(ids)+copies) && pending(t, js, s.name, "work") == 0
	})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	o.Check(t, ids)
	st := c.Stats()
	if st.Duplicates != int64(copies) {
		t.Errorf("Duplicates = %d, want the %d copies", st.Duplicates, copies)
	}
	if st.DeadLettered != 0 || st.Retried != 0 {
		t.Errorf("stats %+v: nothing should be retried or dead-lettered", st)
	}
}

// Poison goes to the dead-letter stream once per message, with its reason
// and a deterministic Nats-Msg-Id, and is terminated: a permanent error, a
// message without an id, a fingerprint mismatch, transient failures past
// MaxAttempts. A dead letter sent again is dropped by the duplicate window.
func TestConsumerDeadLetters(t *testing.T) {
	t.Parallel()
	_, js := testenv.NATS(t)
	s := newStream(t, js, 100*time.Millisecond)
	o := effectstest.New(t, 4)
	fail := func(_ context.Context, msg *consumer.Message) error {
		switch {
		case strings.HasPrefix(msg.ID, "perm"):
			return consumer.Permanent(errors.New("cannot be applied"))
		case strings.HasPrefix(msg.ID, "flaky"):
			return errors.New("still failing")
		}
		return nil
	}
	s.publish(t, "ok-1", []byte("a"), nil)
	s.publish(t, "perm-1", []byte("b"), nil)
	s.publish(t, "", []byte("no id"), nats.Header{"trace": []string{"kept"}})
	s.publish(t, "fp-1", []byte("first"), nil)
	s.publish(t, "flaky-1", []byte("c"), nil)
	var outcomes sync.Map
	c, err := NewConsumer(js, s.name, "work", o.Handler(t, fail), ConsumerOptions{
		Telemetry: consumer.Telemetry{Logger: quiet(), OnOutcome: func(_ context.Context, r consumer.Report) {
			if r.Result.Action == consumer.ActionDeadLetter {
				outcomes.Store(r.Message.ID, r.Outcome)
			}
		}}, Backoff: testBackoff, MaxAttempts: 3,
	})
	if err != nil {
		t.Fatal(err)
	}
	stop := runConsumer(t, c)
	testenv.Eventually(t, 30*time.Second, "ok-1 applied", func() bool { _, d := o.Counts(t); return d >= 1 })
	testenv.Eventually(t, 30*time.Second, "fp-1 applied", func() bool { _, d := o.Counts(t); return d >= 2 })
	time.Sleep(150 * time.Millisecond) // past the duplicate window
	s.publish(t, "fp-1", []byte("second, other content"), nil)
	testenv.Eventually(t, 30*time.Second, "every message settled", func() bool {
		return c.Stats().DeadLettered == 4 && pending(t, js, s.name, "work") == 0
	})
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	o.Check(t, []string{"ok-1", "fp-1"})

	dls := s.deadLetters(t)
	if len(dls) != 4 {
		t.Fatalf("%d dead letters, want 4", len(dls))
	}
	want := map[string]string{"perm-1": "permanent", "": "invalid_key", "fp-1": "fingerprint_mismatch", "flaky-1": "retries_exhausted"}
	for _, m := range dls {
		h := m.Headers()
		orig := h.Get(HeaderMessageID)
		if got := h.Get(HeaderReason); got != want[orig] {
			t.Errorf("dead letter of %q: reason %q, want %q", orig, got, want[orig])
		}
		id := s.name + "/work/" + h.Get(HeaderSequence)
		if h.Get(nats.MsgIdHdr) != id || h.Get(HeaderID) != id {
			t.Errorf("dead letter of %q: Nats-Msg-Id %q, %s %q, want %q", orig, h.Get(nats.MsgIdHdr), HeaderID, h.Get(HeaderID), id)
		}
		if h.Get(HeaderStream) != s.name || h.Get(HeaderConsumer) != "work" || h.Get(HeaderSubject) != s.subject() {
			t.Errorf("dead letter of %q: stream %q, consumer %q, subject %q", orig, h.Get(HeaderStream), h.Get(HeaderConsumer), h.Get(HeaderSubject))
		}
		if h.Get(HeaderError) == "" {
			t.Errorf("dead letter of %q has no %s", orig, HeaderError)
		}
		switch orig {
		case "flaky-1":
			if h.Get(HeaderAttempts) != "3" {
				t.Errorf("flaky-1: %s = %q, want 3", HeaderAttempts, h.Get(HeaderAttempts))
			}
		case "":
			if h.Get("trace") != "kept" || string(m.Data()) != "no id" {
				t.Errorf("the dead letter lost the message's headers or payload: %v %q", h, m.Data())
			}
		}
		delete(want, orig)
	}
	if len(want) != 0 {
		t.Errorf("no dead letter for %v", want)
	}
	for id, reason := range map[string]consumer.Outcome{"perm-1": consumer.OutcomePermanent, "flaky-1": consumer.OutcomeRetriesExhausted} {
		if got, _ := outcomes.Load(id); got != reason {
			t.Errorf("OnOutcome of %s: %v, want %v", id, got, reason)
		}
	}

	// The same dead letter, sent again as a worker that died before Term
	// would send it, is dropped by the dead-letter stream.
	again := &nats.Msg{Subject: s.name + ".dlq", Data: dls[0].Data(), Header: dls[0].Headers()}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ack, err := js.PublishMsg(ctx, again)
	if err != nil {
		t.Fatal(err)
	}
	if !ack.Duplicate {
		t.Error("a dead letter sent again was stored twice")
	}
	if n := len(s.deadLetters(t)); n != 4 {
		t.Errorf("%d dead letters after the second send, want 4", n)
	}
}

// A transient error naks the message with a delay; the next delivery
// applies it, once.
func TestConsumerRetryThenSuccess(t *testing.T) {
	t.Parallel()
	_, js := testenv.NATS(t)
	s := newStream(t, js, 0)
	o := effectstest.New(t, 4)
	var runs atomic.Int64
	flaky := func(_ context.Context, msg *consumer.Message) error {
		if runs.Add(1) <= 2 {
			return fmt.Errorf("transient failure on delivery %d", msg.Attempt)
		}
		return nil
	}
	s.publish(t, "r-1", []byte("x"), nil)
	c, err := NewConsumer(js, s.name, "work", o.Handler(t, flaky), ConsumerOptions{Telemetry: consumer.Telemetry{Logger: quiet()}, Backoff: testBackoff})
	if err != nil {
		t.Fatal(err)
	}
	stop := runConsumer(t, c)
	testenv.Eventually(t, 30*time.Second, "r-1 acknowledged", func() bool { return c.Stats().Acked == 1 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	o.Check(t, []string{"r-1"})
	var attempt int
	if err := o.Pool.QueryRow(context.Background(), "SELECT attempt FROM "+o.Table()).Scan(&attempt); err != nil {
		t.Fatal(err)
	}
	if st := c.Stats(); st.Retried != 2 || attempt != 3 {
		t.Errorf("Retried = %d, applied on delivery %d; want 2 retries and delivery 3", st.Retried, attempt)
	}
}

// A handler that runs past the consumer's AckWait keeps its message: the
// Consumer sends InProgress, and JetStream does not deliver it again.
func TestConsumerInProgress(t *testing.T) {
	t.Parallel()
	_, js := testenv.NATS(t)
	s := newStream(t, js, 0)
	o := effectstest.New(t, 4)
	var runs atomic.Int64
	slow := func(ctx context.Context, _ *consumer.Message) error {
		runs.Add(1)
		select {
		case <-time.After(3 * time.Second): // three AckWaits
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	s.publish(t, "slow-1", []byte("x"), nil)
	c, err := NewConsumer(js, s.name, "work", o.Handler(t, slow), ConsumerOptions{
		Telemetry: consumer.Telemetry{Logger: quiet()}, Config: jetstream.ConsumerConfig{AckWait: time.Second},
	})
	if err != nil {
		t.Fatal(err)
	}
	stop := runConsumer(t, c)
	testenv.Eventually(t, 30*time.Second, "slow-1 acknowledged", func() bool { return c.Stats().Acked == 1 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	o.Check(t, []string{"slow-1"})
	if st := c.Stats(); st.Delivered != 1 || runs.Load() != 1 {
		t.Errorf("delivered %d times, handler ran %d times; want once", st.Delivered, runs.Load())
	}
}

// A graceful stop lets the running handlers finish and acknowledges them,
// naks the messages pulled and not started, and never dead-letters: a
// permanent error returned while stopping sends the message back. The
// next Consumer applies the rest, each message once.
func TestConsumerGracefulStop(t *testing.T) {
	t.Parallel()
	_, js := testenv.NATS(t)
	s := newStream(t, js, 0)
	o := effectstest.New(t, 8)
	ids := s.publishN(t, "g", 20)
	started := make(chan string, 20)
	release := make(chan struct{})
	var stopping atomic.Bool
	block := func(_ context.Context, msg *consumer.Message) error {
		started <- msg.ID
		<-release
		if stopping.Load() && msg.ID == "g-0" {
			return consumer.Permanent(errors.New("refused while stopping"))
		}
		return nil
	}
	c, err := NewConsumer(js, s.name, "work", o.Handler(t, block), ConsumerOptions{Concurrency: 2, Prefetch: 8, Telemetry: consumer.Telemetry{Logger: quiet()}, Backoff: testBackoff})
	if err != nil {
		t.Fatal(err)
	}
	stop := runConsumer(t, c)
	first := map[string]bool{<-started: true, <-started: true}
	stopping.Store(true)
	errc := make(chan error, 1)
	go func() { errc <- stop() }()
	// The pulled messages that did not start are nacked while the two
	// handlers still run.
	testenv.Eventually(t, 30*time.Second, "the waiting messages nacked", func() bool { return c.Stats().Requeued > 0 })
	close(release)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	st := c.Stats()
	if st.DeadLettered != 0 {
		t.Errorf("%d messages dead-lettered while stopping", st.DeadLettered)
	}
	wantAcked := int64(2)
	if first["g-0"] {
		wantAcked = 1 // g-0 was refused and sent back
	}
	if st.Acked != wantAcked {
		t.Errorf("Acked = %d after the stop, want %d (the running handlers)", st.Acked, wantAcked)
	}

	stopping.Store(false)
	c2, err := NewConsumer(js, s.name, "work", o.Handler(t, func(context.Context, *consumer.Message) error { return nil }), ConsumerOptions{Concurrency: 2, Telemetry: consumer.Telemetry{Logger: quiet()}, Backoff: testBackoff})
	if err != nil {
		t.Fatal(err)
	}
	stop2 := runConsumer(t, c2)
	testenv.Eventually(t, 30*time.Second, "every message applied", func() bool { _, d := o.Counts(t); return d == len(ids) })
	testenv.Eventually(t, 30*time.Second, "nothing pending", func() bool { return pending(t, js, s.name, "work") == 0 })
	if err := stop2(); err != nil {
		t.Fatal(err)
	}
	o.Check(t, ids)
}

// A handler cannot settle its delivery: the message MsgFrom returns
// refuses Ack, Nak, Term and InProgress, and the Consumer settles it.
func TestConsumerMsgFrom(t *testing.T) {
	t.Parallel()
	_, js := testenv.NATS(t)
	s := newStream(t, js, 0)
	errs := make(chan error, 4)
	h := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		m, ok := MsgFrom(ctx)
		if !ok || m.Subject() != s.subject() {
			return consumer.Permanent(errors.New("no message in the context"))
		}
		errs <- m.Ack()
		errs <- m.Nak()
		errs <- m.Term()
		errs <- m.InProgress()
		return nil
	})
	s.publish(t, "x-1", []byte("x"), nil)
	c, err := NewConsumer(js, s.name, "work", h, ConsumerOptions{Telemetry: consumer.Telemetry{Logger: quiet()}})
	if err != nil {
		t.Fatal(err)
	}
	stop := runConsumer(t, c)
	testenv.Eventually(t, 30*time.Second, "x-1 acknowledged", func() bool { return c.Stats().Acked == 1 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	for range 4 {
		if err := <-errs; !errors.Is(err, ErrSettledByHandler) {
			t.Errorf("a handler's settlement returned %v, want ErrSettledByHandler", err)
		}
	}
}

// Run refuses a configuration that would lose or loop messages, naming
// the fix.
func TestConsumerSetupErrors(t *testing.T) {
	t.Parallel()
	_, js := testenv.NATS(t)
	s := newStream(t, js, 0)
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	ctx := testenv.Ctx(t)
	for _, tc := range []struct {
		name string
		opts ConsumerOptions
		want string
	}{
		{"dead letters into the work stream", ConsumerOptions{DeadLetterSubject: s.name + ".work.dlq"}, "itself stores the dead-letter subject"},
		{"no dead-letter stream under NoDeclare", ConsumerOptions{NoDeclare: true}, "no stream stores the dead-letter subject"},
		{"missing stream", ConsumerOptions{}, "does not exist"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			stream := s.name
			if tc.name == "missing stream" {
				stream = s.name + "_absent"
			}
			tc.opts.Logger = quiet()
			c, err := NewConsumer(js, stream, "work", h, tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			err = c.Run(ctx)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Run = %v, want an error containing %q", err, tc.want)
			}
			select {
			case <-c.Ready():
				t.Error("Ready closed although Run refused to start")
			default:
			}
		})
	}
	// A durable whose MaxDeliver stops deliveries before MaxDeliveries.
	if _, err := js.CreateOrUpdateConsumer(ctx, s.name, jetstream.ConsumerConfig{Durable: "low", AckPolicy: jetstream.AckExplicitPolicy, MaxDeliver: 3}); err != nil {
		t.Fatal(err)
	}
	c, err := NewConsumer(js, s.name, "low", h, ConsumerOptions{NoDeclare: true, Telemetry: consumer.Telemetry{Logger: quiet()}})
	if err != nil {
		t.Fatal(err)
	}
	_ = c // NoDeclare needs a dead-letter stream: create it through a declaring Consumer first.
	c0, err := NewConsumer(js, s.name, "declarer", h, ConsumerOptions{Telemetry: consumer.Telemetry{Logger: quiet()}})
	if err != nil {
		t.Fatal(err)
	}
	stop := runConsumer(t, c0)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if err := c.Run(ctx); err == nil || !strings.Contains(err.Error(), "MaxDeliver is 3") {
		t.Errorf("Run on a durable with MaxDeliver 3 = %v, want the MaxDeliver error", err)
	}
}

// NewConsumer checks its arguments and options.
func TestNewConsumerErrors(t *testing.T) {
	t.Parallel()
	nc, js := testenv.NATS(t)
	_ = nc
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	for _, tc := range []struct {
		name            string
		stream, durable string
		opts            ConsumerOptions
	}{
		{"empty stream", "", "d", ConsumerOptions{}},
		{"dotted durable", "s", "a.b", ConsumerOptions{}},
		{"prefetch below concurrency", "s", "d", ConsumerOptions{Concurrency: 4, Prefetch: 2}},
		{"ack none", "s", "d", ConsumerOptions{Config: jetstream.ConsumerConfig{AckPolicy: jetstream.AckNonePolicy}}},
		{"backoff", "s", "d", ConsumerOptions{Config: jetstream.ConsumerConfig{BackOff: []time.Duration{time.Second}}}},
		{"max deliver too low", "s", "d", ConsumerOptions{Config: jetstream.ConsumerConfig{MaxDeliver: 5}}},
		{"wildcard dead-letter subject", "s", "d", ConsumerOptions{DeadLetterSubject: "s.>"}},
		{"retry delay too short", "s", "d", ConsumerOptions{Backoff: consumer.Backoff{Initial: time.Microsecond}}},
		{"retry delay too long", "s", "d", ConsumerOptions{Backoff: consumer.Backoff{Max: 25 * time.Hour}}},
		{"backoff factor below 1", "s", "d", ConsumerOptions{Backoff: consumer.Backoff{Factor: 0.5}}},
		{"negative fetch wait", "s", "d", ConsumerOptions{FetchWait: -time.Second}},
		{"negative max deliveries", "s", "d", ConsumerOptions{MaxDeliveries: -2}},
		{"other durable in config", "s", "d", ConsumerOptions{Config: jetstream.ConsumerConfig{Durable: "e"}}},
	} {
		if _, err := NewConsumer(js, tc.stream, tc.durable, h, tc.opts); err == nil {
			t.Errorf("%s: NewConsumer accepted it", tc.name)
		}
	}
	if _, err := NewConsumer(nil, "s", "d", h, ConsumerOptions{}); err == nil {
		t.Error("NewConsumer accepted a nil JetStream")
	}
	if _, err := NewConsumer(js, "s", "d", nil, ConsumerOptions{}); err == nil {
		t.Error("NewConsumer accepted a nil handler")
	}
}

// NewConsumer refuses a MaxAttempts that the delivery bounds would never
// let a message reach: JetStream counts every delivery, and a message
// delivered more than MaxDeliveries times (which the durable's MaxDeliver
// must exceed) is dead-lettered as redelivery_limit first.
func TestNewConsumerMaxAttemptsAboveMaxDeliveries(t *testing.T) {
	_, js := testenv.NATS(t)
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	for _, tc := range []struct {
		name    string
		opts    ConsumerOptions
		wantErr string // empty: accepted
	}{
		{"above the default MaxDeliveries", ConsumerOptions{MaxAttempts: 11},
			"nats: ConsumerOptions.MaxAttempts (11) is greater than MaxDeliveries (10)"},
		{"above MaxDeliveries and the durable's MaxDeliver", ConsumerOptions{MaxAttempts: 8, MaxDeliveries: 5,
			Config: jetstream.ConsumerConfig{MaxDeliver: 6}}, "nats: ConsumerOptions.MaxAttempts (8) is greater than MaxDeliveries (5)"},
		{"MaxDeliver at or below MaxAttempts", ConsumerOptions{MaxAttempts: 4, MaxDeliveries: 4,
			Config: jetstream.ConsumerConfig{MaxDeliver: 4}}, "the durable consumer's MaxDeliver is 4"},
		{"equal to MaxDeliveries", ConsumerOptions{MaxAttempts: 10}, ""},
		{"equal, below MaxDeliver", ConsumerOptions{MaxAttempts: 6, MaxDeliveries: 6,
			Config: jetstream.ConsumerConfig{MaxDeliver: 7}}, ""},
		{"no delivery bound", ConsumerOptions{MaxAttempts: 1000, MaxDeliveries: -1}, ""},
	} {
		_, err := NewConsumer(js, "s", "d", h, tc.opts)
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("%s: NewConsumer: %v", tc.name, err)
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("%s: NewConsumer = %v, want an error containing %q", tc.name, err, tc.wantErr)
		}
	}
}

// The delay after a failed delivery is Backoff's for the delivery count,
// or the store's hint when that is longer, never more than 24h; the zero
// Backoff gives 1s, 5s, 25s, 2m.
func TestRetryDelay(t *testing.T) {
	_, js := testenv.NATS(t)
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	c, err := NewConsumer(js, "s", "d", h, ConsumerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	o := c.opts
	for _, tc := range []struct {
		n    int
		hint time.Duration
		want time.Duration
	}{
		{1, 0, time.Second},
		{2, 0, 5 * time.Second},
		{3, 0, 25 * time.Second},
		{4, 0, 2 * time.Minute},
		{40, 0, 2 * time.Minute},
		{1, 3 * time.Second, 3 * time.Second},
		{2, 3 * time.Second, 5 * time.Second},
		{1, 48 * time.Hour, 24 * time.Hour},
	} {
		if got := o.retryDelay(tc.n, tc.hint); got != tc.want {
			t.Errorf("retryDelay(%d, %v) = %v, want %v", tc.n, tc.hint, got, tc.want)
		}
	}
}
