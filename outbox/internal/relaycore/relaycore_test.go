package relaycore

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
)

func TestFillIntsAndDurations(t *testing.T) {
	var a, b int
	if err := FillInts("x: O.", Int{Name: "A", V: &a, Def: 5, Max: 10}, Int{Name: "B", V: &b, Def: 1, Max: 3}); err != nil || a != 5 || b != 1 {
		t.Fatalf("defaults: a=%d b=%d err=%v", a, b, err)
	}
	a, b = -1, 0
	if err := FillInts("x: O.", Int{Name: "A", V: &a, Def: 5, Max: 10}); err == nil || err.Error() != "x: O.A is -1; it must not be negative (zero means the default)" {
		t.Fatalf("negative: %v", err)
	}
	a = 11
	if err := FillInts("x: O.", Int{Name: "A", V: &a, Def: 5, Max: 10}); err == nil || err.Error() != "x: O.A is 11; the most is 10" {
		t.Fatalf("too large: %v", err)
	}
	var d time.Duration
	if err := FillDurations("x: O.", Duration{Name: "D", V: &d, Def: time.Second}); err != nil || d != time.Second {
		t.Fatalf("default: %v %v", d, err)
	}
	d = time.Microsecond
	if err := FillDurations("x: O.", Duration{Name: "D", V: &d, Def: time.Second}); err == nil || err.Error() != "x: O.D is 1µs; use at least 1ms" {
		t.Fatalf("too short: %v", err)
	}
}

func TestFillCommon(t *testing.T) {
	def := slog.New(slog.DiscardHandler)
	fill := func(bo, rbo consumer.Backoff, tel consumer.Telemetry) (consumer.Backoff, consumer.Backoff, consumer.Telemetry, time.Duration, error) {
		var cleanup time.Duration
		err := FillCommon("x: O.", Common{Backoff: &bo, BackoffDef: consumer.Backoff{Initial: time.Second, Max: time.Minute},
			ReconnectBackoff: &rbo, CleanupInterval: &cleanup, Telemetry: &tel}, def)
		return bo, rbo, tel, cleanup, err
	}
	bo, rbo, tel, cleanup, err := fill(consumer.Backoff{}, consumer.Backoff{Max: time.Second}, consumer.Telemetry{})
	if err != nil {
		t.Fatal(err)
	}
	if want := (consumer.Backoff{Initial: time.Second, Max: time.Minute, Factor: 2}); bo != want {
		t.Errorf("Backoff = %+v, want %+v", bo, want)
	}
	if want := (consumer.Backoff{Initial: 100 * time.Millisecond, Max: time.Second, Factor: 2}); rbo != want {
		t.Errorf("ReconnectBackoff = %+v, want %+v", rbo, want)
	}
	if tel.Logger != def || cleanup != time.Minute {
		t.Errorf("Logger %v, CleanupInterval %v: want the default logger and 1m", tel.Logger, cleanup)
	}
	for _, tc := range []struct {
		bo, rbo consumer.Backoff
		tel     consumer.Telemetry
		want    string
	}{
		{bo: consumer.Backoff{Initial: 2 * time.Second, Max: time.Second}, want: "x: O.Backoff: Initial (2s) is greater than Max (1s)"},
		{rbo: consumer.Backoff{Initial: -1}, want: "x: O.ReconnectBackoff: Initial is -1ns; it must be positive (or zero for 100ms)"},
		{rbo: consumer.Backoff{Initial: time.Microsecond}, want: "x: O.ReconnectBackoff.Initial is 1µs; use at least 1ms"},
		{bo: consumer.Backoff{Factor: 0.5}, want: "x: O.Backoff: Factor is 0.5; it must be at least 1 (or zero for 2)"},
		{tel: consumer.Telemetry{OnOutcome: func(context.Context, consumer.Report) {}}, want: "x: O.OnOutcome is set, but a relay reports no consumer.Report"},
	} {
		if _, _, _, _, err := fill(tc.bo, tc.rbo, tc.tel); err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("FillCommon = %v, want an error starting with %q", err, tc.want)
		}
	}
}

func TestRetryDelayAndGrowing(t *testing.T) {
	b := consumer.Backoff{Initial: time.Second, Max: 30 * time.Second, Factor: 3}
	for n, want := range map[int]time.Duration{1: time.Second, 2: 3 * time.Second, 3: 9 * time.Second, 4: 27 * time.Second, 5: 30 * time.Second} {
		if d := RetryDelay(b, n); d < 8*want/10 || d > 12*want/10 {
			t.Errorf("RetryDelay(n=%d) = %v, want %v ±20%%", n, d, want)
		}
	}
	g := Growing(b)
	for i, want := range []time.Duration{time.Second, 3 * time.Second, 9 * time.Second, 27 * time.Second, 30 * time.Second} {
		if d := g.Next(); d < 8*want/10 || d > 12*want/10 {
			t.Errorf("Growing delay %d = %v, want %v ±20%%", i, d, want)
		}
	}
}

func TestPublish(t *testing.T) {
	msgs := []*outbox.Message{{ID: "a", Topic: "t"}, {ID: "b", Topic: "t"}}
	down := errors.New("down")
	var seen error
	after := func(_ []*outbox.Message, err error) { seen = err }

	_, _, err := Publish(context.Background(), nil, publisherFunc(func([]*outbox.Message) error { return down }), msgs, "p: ", after)
	var pf *PublishFailure
	if !errors.As(err, &pf) || !errors.Is(err, down) || err.Error() != "p: publish: down" || seen != down {
		t.Fatalf("whole batch: err=%v seen=%v", err, seen)
	}

	tel := NewTelemetry(nil, nil, "s.t", "delay")
	pe, _, err := Publish(context.Background(), tel, publisherFunc(func([]*outbox.Message) error {
		return &outbox.PublishError{Failed: map[int]error{1: nil}}
	}), msgs, "p: ", nil)
	if err != nil || pe == nil {
		t.Fatalf("per message: pe=%v err=%v", pe, err)
	}
	if failed, ferr := Failed(pe, 0); failed || ferr != nil {
		t.Fatalf("message 0: %v %v", failed, ferr)
	}
	if failed, ferr := Failed(pe, 1); !failed || ferr == nil || ferr.Error() != "not confirmed" {
		t.Fatalf("message 1: %v %v", failed, ferr)
	}
	if failed, _ := Failed(nil, 0); failed {
		t.Fatal("nil PublishError: a message failed")
	}
}

type publisherFunc func([]*outbox.Message) error

func (f publisherFunc) Publish(_ context.Context, msgs []*outbox.Message) error { return f(msgs) }

func TestTruncateAndDecodeHeaders(t *testing.T) {
	if got := Truncate("ab\x00c\xffdé", 7); got != "abcd" {
		t.Fatalf("Truncate = %q", got)
	}
	h := DecodeHeaders(`{"a":"x","n":1,"o":{"k":true}}`)
	if h["a"] != "x" || h["n"] != "1" || h["o"] != `{"k":true}` {
		t.Fatalf("DecodeHeaders = %v", h)
	}
	if DecodeHeaders("not json") != nil {
		t.Fatal("DecodeHeaders of a broken column is not nil")
	}
}

func TestDeleteBatches(t *testing.T) {
	left := []int64{3, 3, 1, 3}
	calls := 0
	n, err := DeleteBatches(context.Background(), 3, func(context.Context) (int64, error) {
		calls++
		v := left[0]
		left = left[1:]
		return v, nil
	})
	if err != nil || n != 7 || calls != 3 {
		t.Fatalf("DeleteBatches = %d, %v after %d statements; want 7 after 3", n, err, calls)
	}
	boom := errors.New("boom")
	n, err = DeleteBatches(context.Background(), 3, func(context.Context) (int64, error) {
		if calls++; calls > 4 {
			return 0, boom
		}
		return 3, nil
	})
	if !errors.Is(err, boom) || n != 3 {
		t.Fatalf("after an error: %d, %v; want 3, boom", n, err)
	}
}

func TestGraceful(t *testing.T) {
	parent, cancel := context.WithCancel(context.Background())
	ctx, release := Graceful(parent, time.Hour)
	cancel()
	if ctx.Err() != nil {
		t.Fatal("cancelled with its parent, before the grace period")
	}
	release()
	if ctx.Err() == nil {
		t.Fatal("not cancelled by release")
	}
}

func TestPGLayout(t *testing.T) {
	if got := PGChannel("public", "outbox"); got != "idem_outbox.public.outbox" {
		t.Fatalf("PGChannel = %q", got)
	}
	long := PGChannel("public", strings.Repeat("x", 60))
	if len(long) > 63 || !strings.HasPrefix(long, "idem_outbox.") || long != PGChannel("public", strings.Repeat("x", 60)) {
		t.Fatalf("PGChannel of a long name = %q", long)
	}
	id1, id2 := uuid.New(), uuid.New()
	if PGKeyHash([]byte("k"), id1) != PGKeyHash([]byte("k"), id2) {
		t.Fatal("a key's shard hash depends on the id")
	}
	if h := PGKeyHash(nil, id1); h < 0 {
		t.Fatalf("PGKeyHash = %d, negative", h)
	}
	ns := PGKeyLockNS("public", "outbox")
	if PGKeyLockID(ns, []byte("a")) == PGKeyLockID(ns, []byte("b")) || ns == PGKeyLockNS("public", "other") {
		t.Fatal("lock ids collide")
	}
}
