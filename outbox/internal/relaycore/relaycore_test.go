package relaycore

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

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
	var cleanup time.Duration
	c := Common{Backoff: 2 * time.Second, MaxBackoff: time.Second, CleanupInterval: &cleanup}
	if err := FillCommon("x: O.", c, nil); err == nil || !strings.Contains(err.Error(), "MaxBackoff 1s is shorter than Backoff 2s") {
		t.Fatalf("backoff pair: %v", err)
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
