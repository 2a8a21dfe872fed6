package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	idemnats "github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// natsStream creates a work stream storing "<name>.work.>" with duplicate
// window dup, runs a Consumer of it with the oracle's handler, and returns
// the stream's name; the streams are deleted when the test ends.
func natsStream(t *testing.T, js jetstream.JetStream, oracle *poisonOracle, dup time.Duration) string {
	t.Helper()
	name := strings.ReplaceAll(testenv.UniqueID("idemdl"), "-", "_")
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".work.>"}, Duplicates: dup}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, name)
		_ = js.DeleteStream(ctx, name+"-dlq")
	})
	c, err := idemnats.NewConsumer(js, name, "work", oracle.handler(t, "billing/charge"), idemnats.ConsumerOptions{
		Telemetry: consumer.Telemetry{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))},
	})
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(cctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("consumer: %v", err)
		}
	})
	select {
	case <-c.Ready():
	case <-time.After(30 * time.Second):
		t.Fatal("the consumer is not ready")
	}
	return name
}

func natsPublish(t *testing.T, js jetstream.JetStream, subject, id, payload string) {
	t.Helper()
	if _, err := js.PublishMsg(testenv.Ctx(t), &nats.Msg{Subject: subject, Data: []byte(payload), Header: nats.Header{nats.MsgIdHdr: {id}}}); err != nil {
		t.Fatal(err)
	}
}

// natsMsgs is the number of messages in stream, 0 while it does not exist
// (the Consumer creates the dead-letter stream).
func natsMsgs(t *testing.T, js jetstream.JetStream, stream string) uint64 {
	t.Helper()
	s, err := js.Stream(testenv.Ctx(t), stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(testenv.Ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Msgs
}

// TestDeadletterNATS dead-letters messages through the NATS Consumer,
// lists them by reason, discards one, replays nothing with --dry-run,
// fixes the handler and replays the rest in two runs (the first cut short
// by --limit), deleting each letter from the dead-letter stream once the
// work stream acknowledged its replay; the oracle checks that every
// message but the discarded one was applied exactly once.
func TestDeadletterNATS(t *testing.T) {
	_, js := testenv.NATS(t)
	oracle := newPoisonOracle(t)
	// A duplicate window of one second: the replays, published after it,
	// are not dropped by the work stream as copies of the originals.
	stream := natsStream(t, js, oracle, time.Second)
	ok, bad, boom := ids("ok", 5), ids("bad", 4), ids("boom", 2)
	for _, id := range ok {
		natsPublish(t, js, stream+".work.a", id, "ok-"+id)
	}
	for _, id := range bad {
		natsPublish(t, js, stream+".work.a", id, "bad-"+id)
	}
	for _, id := range boom {
		natsPublish(t, js, stream+".work.b", id, "boom-"+id)
	}
	dlq := stream + "-dlq"
	testenv.Eventually(t, 60*time.Second, "6 dead letters and 5 messages applied", func() bool {
		return natsMsgs(t, js, dlq) == 6 && len(oracle.applied(t)) == 5
	})
	oracle.check(t, ok)

	r := dlqRun{t: t, flags: []string{"--nats", testenv.NATSURL(), "--stream", dlq}}
	out := r.run(0, "list")
	if groupCount(t, out, "permanent", stream+".work.a") != 4 || groupCount(t, out, "panic", stream+".work.b") != 2 {
		t.Fatalf("list:\n%s\nwant 4 permanent letters from %s.work.a and 2 panic from .work.b", out, stream)
	}
	out = r.run(0, "show", boom[0])
	for _, want := range []string{"message id   " + boom[0], "reason       panic", `payload      11 bytes: "boom-` + boom[0] + `"`,
		"  idem-dlq-message-id: " + boom[0]} {
		if !strings.Contains(out, want) {
			t.Errorf("show lacks %q:\n%s", want, out)
		}
	}
	out = r.run(0, "discard", "--all", "--dry-run")
	if s := summary(t, out); !strings.Contains(s, "would discard 6") || natsMsgs(t, js, dlq) != 6 {
		t.Fatalf("dry run: %q, %d letters left", s, natsMsgs(t, js, dlq))
	}
	r.run(0, "discard", "--id", boom[1])
	if n := natsMsgs(t, js, dlq); n != 5 {
		t.Fatalf("%d letters after the discard, want 5", n)
	}

	oracle.fixed.Store(true)
	time.Sleep(1500 * time.Millisecond) // past the work stream's duplicate window
	replayed1, _ := summaryCounts(t, r.run(0, "replay", "--reason", "permanent", "--limit", "3"))
	replayed2, _ := summaryCounts(t, r.run(0, "replay", "--all"))
	if replayed1 != 3 || replayed2 != 2 {
		t.Errorf("replays: %d then %d, want 3 then 2", replayed1, replayed2)
	}
	if n := natsMsgs(t, js, dlq); n != 0 {
		t.Fatalf("%d letters after every replay, want 0", n)
	}
	oracle.waitApplied(t, append(append(append([]string{}, ok...), bad...), boom[0]))
}

// TestDeadletterNATSDuplicateWindow: a replay published within the work
// stream's duplicate window is dropped by JetStream as a copy of the
// original; the tool says so, exits 1 and leaves the letter in place.
func TestDeadletterNATSDuplicateWindow(t *testing.T) {
	_, js := testenv.NATS(t)
	oracle := newPoisonOracle(t)
	stream := natsStream(t, js, oracle, 2*time.Minute)
	natsPublish(t, js, stream+".work.a", "bad-0", "bad-0")
	dlq := stream + "-dlq"
	testenv.Eventually(t, 60*time.Second, "a dead letter", func() bool { return natsMsgs(t, js, dlq) == 1 })
	oracle.fixed.Store(true)
	r := dlqRun{t: t, flags: []string{"--nats", testenv.NATSURL(), "--stream", dlq}}
	out := r.run(1, "replay", "--all")
	if s := summary(t, out); !strings.Contains(s, "0 replayed, 0 copies removed, 1 not replayed") || !strings.Contains(out, "duplicate window") {
		t.Errorf("replay within the window:\n%s", out)
	}
	if n := natsMsgs(t, js, dlq); n != 1 {
		t.Errorf("%d letters after a replay JetStream dropped, want 1", n)
	}
	oracle.check(t, nil)
}
