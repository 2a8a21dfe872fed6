package main

import (
	"context"
	"io"
	"log/slog"
	"regexp"
	"strconv"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// amqpDepth is the number of ready messages of queue.
func amqpDepth(t *testing.T, conn *amqp091.Connection, queue string) int {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ch.Close() }()
	q, err := ch.QueueDeclarePassive(queue, false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return q.Messages
}

// amqpPublish publishes p to queue through the default exchange and waits
// for the confirm.
func amqpPublish(t *testing.T, conn *amqp091.Connection, queue string, ps ...amqp091.Publishing) {
	t.Helper()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ch.Close() }()
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	for _, p := range ps {
		dc, err := ch.PublishWithDeferredConfirmWithContext(testenv.Ctx(t), "", queue, true, false, p)
		if err != nil {
			t.Fatal(err)
		}
		if ok, err := dc.WaitContext(testenv.Ctx(t)); err != nil || !ok {
			t.Fatalf("publish to %s: confirm %v, %v", queue, ok, err)
		}
	}
}

// summaryCounts reads the counts of a replay's summary line.
func summaryCounts(t *testing.T, out string) (replayed, copies int) {
	t.Helper()
	m := regexp.MustCompile(`: (\d+) replayed, (\d+) copies removed`).FindStringSubmatch(summary(t, out))
	if m == nil {
		t.Fatalf("no counts in %q", summary(t, out))
	}
	replayed, _ = strconv.Atoi(m[1])
	copies, _ = strconv.Atoi(m[2])
	return replayed, copies
}

// TestDeadletterRabbitMQ dead-letters messages through the RabbitMQ
// Consumer (permanent errors, panics, a producer's duplicate of a poison
// message), lists them by reason, replays nothing with --dry-run, discards
// one, fixes the handler, replays the rest in two runs (the first cut
// short by --limit), and checks with the oracle that every message but the
// discarded one was applied exactly once. A message dead-lettered twice
// (two letters of one id in the queue) is published once by a replay,
// which removes the second letter as a copy.
func TestDeadletterRabbitMQ(t *testing.T) {
	requireRabbitMQ(t)
	url := testenv.AMQPURL()
	conn, err := amqp091.DialConfig(url, amqp091.Config{Dial: amqp091.DefaultDial(5 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	queue := testenv.Name("idemdl")
	opts := idemamqp.ConsumerOptions{Telemetry: consumer.Telemetry{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := idemamqp.DeleteTopology(ctx, conn, queue, opts); err != nil {
			t.Errorf("delete topology: %v", err)
		}
	})
	oracle := newPoisonOracle(t)
	startAMQPConsumer(t, url, queue, oracle, opts)

	ok, bad, boom := ids("ok", 6), ids("bad", 4), ids("boom", 2)
	var ps []amqp091.Publishing
	add := func(id, payload string) {
		ps = append(ps, amqp091.Publishing{MessageId: id, DeliveryMode: amqp091.Persistent, ContentType: "text/plain", Body: []byte(payload)})
	}
	for _, id := range ok {
		add(id, "ok-"+id)
	}
	for _, id := range bad {
		add(id, "bad-"+id)
	}
	for _, id := range boom {
		add(id, "boom-"+id)
	}
	add(bad[0], "bad-"+bad[0]) // a producer's duplicate
	amqpPublish(t, conn, queue, ps...)
	dlq := queue + ".dlq"
	testenv.Eventually(t, 60*time.Second, "7 dead letters and 6 messages applied", func() bool {
		return amqpDepth(t, conn, dlq) == 7 && len(oracle.applied(t)) == 6
	})
	oracle.check(t, ok)

	r := dlqRun{t: t, flags: []string{"--amqp", url, "--queue", dlq}}
	out := r.run(0, "list")
	if groupCount(t, out, "permanent", queue) != 5 || groupCount(t, out, "panic", queue) != 2 {
		t.Fatalf("list:\n%s\nwant 5 permanent and 2 panic letters from %s", out, queue)
	}
	if n := amqpDepth(t, conn, dlq); n != 7 {
		t.Fatalf("%d letters in the queue after list, want 7: list returns what it took", n)
	}
	out = r.run(0, "show", boom[1])
	for _, want := range []string{"reason       panic", "source       " + queue, `payload      11 bytes: "boom-` + boom[1] + `"`,
		"  (message-id): " + boom[1], "  idem-dlq-id: " + boom[1]} {
		if !regexp.MustCompile(regexp.QuoteMeta(want)).MatchString(out) {
			t.Errorf("show lacks %q:\n%s", want, out)
		}
	}

	out = r.run(0, "replay", "--all", "--dry-run")
	if s := summary(t, out); !regexp.MustCompile(`dry run.*would replay 6.*would remove 1 copies`).MatchString(s) {
		t.Errorf("dry run: %q", s)
	}
	if n := amqpDepth(t, conn, dlq); n != 7 {
		t.Fatalf("%d letters after the dry run, want 7", n)
	}
	oracle.check(t, ok)

	out = r.run(0, "discard", "--id", boom[1])
	if s := summary(t, out); !regexp.MustCompile(`: 1 discarded`).MatchString(s) {
		t.Errorf("discard: %q", s)
	}
	if n := amqpDepth(t, conn, dlq); n != 6 {
		t.Fatalf("%d letters after the discard, want 6", n)
	}

	oracle.fixed.Store(true)
	replayed1, copies1 := summaryCounts(t, r.run(0, "replay", "--reason", "permanent", "--limit", "2"))
	replayed2, copies2 := summaryCounts(t, r.run(0, "replay", "--reason", "permanent"))
	// Five permanent letters: four messages, one of them twice. Each run
	// removes a copy it replayed the original of; a copy left to the
	// second run is replayed, and dropped by the consumer's claim.
	if replayed1 != 2 || replayed1+copies1+replayed2+copies2 != 5 || copies1+copies2 > 1 {
		t.Errorf("replays: %d+%d copies, then %d+%d copies; want 5 letters in all, 2 in the first run", replayed1, copies1, replayed2, copies2)
	}
	r.run(0, "replay", "--reason", "panic")
	if n := amqpDepth(t, conn, dlq); n != 0 {
		t.Fatalf("%d letters after every replay, want 0", n)
	}
	want := append(append(append([]string{}, ok...), bad...), boom[0])
	oracle.waitApplied(t, want)

	// A message dead-lettered twice: the worker died after the letter's
	// confirm and before its ack. One replay publishes it once.
	late := amqp091.Publishing{MessageId: "late-0", DeliveryMode: amqp091.Persistent, Body: []byte("bad-late-0"),
		Headers: amqp091.Table{consumer.HeaderID: "late-0", consumer.HeaderReason: "permanent", consumer.HeaderSource: queue,
			consumer.HeaderError: "cannot parse bad-late-0", consumer.HeaderAttempts: int32(1), idemamqp.HeaderAttempt: int32(1)}}
	amqpPublish(t, conn, dlq, late, late)
	replayed, copies := summaryCounts(t, r.run(0, "replay", "--id", "late-0"))
	if replayed != 1 || copies != 1 {
		t.Errorf("replay of a letter and its copy: %d replayed, %d copies removed; want 1 and 1", replayed, copies)
	}
	want = append(want, "late-0")
	oracle.waitApplied(t, want)
	testenv.Eventually(t, 30*time.Second, "the producer's duplicate delivered", func() bool {
		return oracle.delivered(bad[0]) >= 3
	})
	oracle.check(t, want)
	if n := oracle.delivered("late-0"); n != 1 {
		t.Errorf("late-0 delivered %d times, want 1 (its copy is not published)", n)
	}
}
