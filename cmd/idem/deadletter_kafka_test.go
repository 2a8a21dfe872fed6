package main

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/kafkatest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// kafkaEnds is the sum of the end offsets of topic's partitions.
func kafkaEnds(t *testing.T, env *kafkatest.Env, topic string, partitions int) int64 {
	t.Helper()
	req := make([]kafkago.OffsetRequest, partitions)
	for i := range req {
		req[i] = kafkago.LastOffsetOf(i)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := env.Client.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{topic: req}})
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, p := range res.Topics[topic] {
		n += p.LastOffset
	}
	return n
}

// kafkaCommitted reports whether group committed anything on topic.
func kafkaCommitted(t *testing.T, env *kafkatest.Env, group, topic string, partitions int) bool {
	t.Helper()
	ps := make([]int, partitions)
	for i := range ps {
		ps[i] = i
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := env.Client.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: ps}})
	if err == nil {
		err = res.Error
	}
	if errors.Is(err, kafkago.GroupIdNotFound) {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range res.Topics[topic] {
		if p.Error == nil && p.CommittedOffset >= 0 {
			return true
		}
	}
	return false
}

// runKafkaConsumer runs a Consumer of work with oracle's handler,
// dead-lettering to dlq, until the test ends.
func runKafkaConsumer(t *testing.T, env *kafkatest.Env, work, dlq string, oracle *poisonOracle) {
	t.Helper()
	c, err := idemkafka.NewConsumer(kafkago.ReaderConfig{
		Brokers: env.Brokers, GroupID: testenv.Name("g"), Topic: work,
		HeartbeatInterval: 100 * time.Millisecond, SessionTimeout: 10 * time.Second, RebalanceTimeout: 20 * time.Second,
		JoinGroupBackoff: 100 * time.Millisecond, MaxWait: 100 * time.Millisecond,
		ReadBackoffMin: 10 * time.Millisecond, ReadBackoffMax: 100 * time.Millisecond,
	}, oracle.handler(t, "billing/charge"), idemkafka.ConsumerOptions{DeadLetterTopic: dlq, CommitInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("consumer: %v", err)
		}
	})
}

// TestDeadletterKafka dead-letters messages through the Kafka Consumer (a
// poison handler: permanent errors and panics, and a producer's duplicate
// of two poison messages), lists them by reason, shows one, replays nothing
// with --dry-run, discards one, fixes the handler and replays the rest in
// runs bounded by --limit, and checks with the oracle that every message
// but the discarded one was applied exactly once. A second replay of the
// same letters under another tool group (progress lost) publishes them
// again: the consumer's claim drops every copy.
func TestDeadletterKafka(t *testing.T) {
	env := kafkatest.New(t)
	work := env.Topic(t, "dlwork", 2)
	dlq := work + "_dlq"
	env.CreateTopic(t, dlq, 2)
	oracle := newPoisonOracle(t)

	runKafkaConsumer(t, env, work, dlq, oracle)

	ok, bad, boom := ids("ok", 10), ids("bad", 6), ids("boom", 4)
	var recs []kafkago.Message
	add := func(id, payload string, p int) {
		recs = append(recs, kafkago.Message{Partition: p, Key: []byte("k-" + id), Value: []byte(payload),
			Headers: []kafkago.Header{{Key: outbox.HeaderMessageID, Value: []byte(id)}}})
	}
	for i, id := range ok {
		add(id, "ok-"+id, i%2)
	}
	for i, id := range bad {
		add(id, "bad-"+id, i%2)
	}
	for i, id := range boom {
		add(id, "boom-"+id, i%2)
	}
	// A producer published two poison messages twice, same id and content.
	add(bad[0], "bad-"+bad[0], 0)
	add(bad[1], "bad-"+bad[1], 1)
	w := &kafkago.Writer{Addr: kafkago.TCP(env.Brokers...), Topic: work, Transport: env.Transport, RequiredAcks: kafkago.RequireAll,
		Balancer: kafkago.BalancerFunc(func(m kafkago.Message, _ ...int) int { return m.Partition })}
	if err := w.WriteMessages(testenv.Ctx(t), recs...); err != nil {
		t.Fatal(err)
	}
	_ = w.Close()
	testenv.Eventually(t, 60*time.Second, "12 dead letters and 10 messages applied", func() bool {
		return kafkaEnds(t, env, dlq, 2) == 12 && len(oracle.applied(t)) == 10
	})
	oracle.check(t, ok)

	tool := testenv.Name("tool")
	r := dlqRun{t: t, flags: []string{"--kafka", strings.Join(env.Brokers, ","), "--topic", dlq, "--group", tool}}
	out := r.run(0, "list")
	if groupCount(t, out, "permanent", work) != 8 || groupCount(t, out, "panic", work) != 4 || !strings.Contains(out, "12 dead letters") ||
		!strings.Contains(out, `"cannot parse bad-`) {
		t.Fatalf("list:\n%s\nwant 8 permanent and 4 panic letters from %s", out, work)
	}
	out = r.run(0, "show", boom[3])
	for _, want := range []string{"message id   " + boom[3], "reason       panic", "source       " + work,
		`payload      11 bytes: "boom-` + boom[3] + `"`, "  idem-dlq-reason: panic", "  " + outbox.HeaderMessageID + ": " + boom[3]} {
		if !strings.Contains(out, want) {
			t.Errorf("show %s lacks %q:\n%s", boom[3], want, out)
		}
	}
	r.run(exitAbsent, "show", "no-such-id")

	out = r.run(0, "replay", "--all", "--dry-run")
	if s := summary(t, out); !strings.Contains(s, "(dry run, nothing changed): would replay 12, would remove 0 copies") {
		t.Errorf("dry run: %q", s)
	}
	if r.count() != 12 || kafkaCommitted(t, env, tool, dlq, 2) {
		t.Fatal("the dry run changed something")
	}

	out = r.run(0, "discard", "--id", boom[3])
	if s := summary(t, out); !strings.Contains(s, ": 1 discarded") {
		t.Errorf("discard: %q", s)
	}
	if n := r.count(); n != 11 {
		t.Fatalf("%d dead letters after the discard, want 11", n)
	}

	oracle.fixed.Store(true)
	// An interrupted replay: 3 of the 8 permanent letters, then the rest.
	out = r.run(0, "replay", "--reason", "permanent", "--limit", "3")
	if s := summary(t, out); !strings.Contains(s, ": 3 replayed") || !strings.Contains(s, "--limit reached") {
		t.Errorf("replay --limit 3: %q", s)
	}
	out = r.run(0, "replay", "--reason", "permanent")
	if s := summary(t, out); !strings.Contains(s, ": 5 replayed") || !strings.Contains(s, "3 not selected") {
		t.Errorf("replay of the rest: %q", s)
	}
	out = r.run(0, "list")
	if groupCount(t, out, "permanent", work) != 0 || groupCount(t, out, "panic", work) != 3 {
		t.Fatalf("list after the permanent replays:\n%s", out)
	}
	r.run(0, "replay", "--reason", "panic")
	if n := r.count(); n != 0 {
		t.Fatalf("%d dead letters after every replay, want 0", n)
	}
	want := append(append(append([]string{}, ok...), bad...), boom[:3]...)
	oracle.waitApplied(t, want)
	// Each poison message was delivered, dead-lettered and replayed once
	// (twice for the two the producer sent twice: one copy applied, the
	// other dropped by the claim).
	testenv.Eventually(t, 60*time.Second, "every replay delivered", func() bool {
		return oracle.delivered(bad[0]) == 4 && oracle.delivered(bad[1]) == 4 && oracle.delivered(boom[0]) == 2
	})
	oracle.check(t, want)

	// Progress lost: another tool group replays the permanent letters
	// again. Their messages are applied already; the claim drops them.
	r2 := dlqRun{t: t, flags: []string{"--kafka", strings.Join(env.Brokers, ","), "--topic", dlq, "--group", testenv.Name("tool")}}
	out = r2.run(0, "replay", "--reason", "permanent")
	if s := summary(t, out); !strings.Contains(s, ": 8 replayed") {
		t.Errorf("second replay: %q", s)
	}
	testenv.Eventually(t, 60*time.Second, "the second replay delivered", func() bool {
		for _, id := range bad[2:] {
			if oracle.delivered(id) != 3 {
				return false
			}
		}
		return oracle.delivered(bad[0]) == 6
	})
	oracle.check(t, want)
	// The first tool group's progress holds: nothing is read again.
	if n := r.count(); n != 0 {
		t.Errorf("%d dead letters for the first tool group after the second replay, want 0", n)
	}
}

// TestDeadletterKafkaReplayKilled SIGKILLs "idem deadletter replay" on a
// Kafka dead-letter topic part way through, then runs it again. The
// killed run's progress is the last commit of its tool group, so the
// second run publishes again the letters replayed since (up to a
// commit's worth) and the consumer's claim drops those copies: every
// message is applied exactly once, and no letter is left.
func TestDeadletterKafkaReplayKilled(t *testing.T) {
	env := kafkatest.New(t)
	work := env.Topic(t, "dlwork", 2)
	dlq := work + "_dlq"
	env.CreateTopic(t, dlq, 2)
	oracle := newPoisonOracle(t)
	oracle.fixed.Store(true)
	runKafkaConsumer(t, env, work, dlq, oracle)

	// Letters as the Consumer parks them: the reason, the source topic and
	// partition, the message id.
	const n = 3000
	want := ids("k", n)
	letters := make([]kafkago.Message, n)
	for i, id := range want {
		p := i % 2
		letters[i] = kafkago.Message{Partition: p, Key: []byte("k-" + id), Value: []byte("ok-" + id), Headers: []kafkago.Header{
			{Key: outbox.HeaderMessageID, Value: []byte(id)},
			{Key: consumer.HeaderReason, Value: []byte(consumer.OutcomePermanent)},
			{Key: consumer.HeaderSource, Value: []byte(work)},
			{Key: idemkafka.HeaderPartition, Value: []byte(strconv.Itoa(p))},
		}}
	}
	w := &kafkago.Writer{Addr: kafkago.TCP(env.Brokers...), Topic: dlq, Transport: env.Transport, RequiredAcks: kafkago.RequireAll,
		Balancer: kafkago.BalancerFunc(func(m kafkago.Message, _ ...int) int { return m.Partition }), BatchSize: 500}
	if err := w.WriteMessages(testenv.Ctx(t), letters...); err != nil {
		t.Fatal(err)
	}
	_ = w.Close()

	flags := []string{"--kafka", strings.Join(env.Brokers, ","), "--topic", dlq, "--group", testenv.Name("tool")}
	cmd, exited, out := startProcess(t, append([]string{"deadletter", "replay", "--all", "--limit", "10000"}, flags...)...)
	testenv.Eventually(t, 2*time.Minute, "350 letters replayed", func() bool {
		select {
		case err := <-exited:
			t.Fatalf("the replay ended before it was killed (%v): more letters are needed to kill it part way\n%s", err, out.String())
		default:
		}
		return kafkaEnds(t, env, work, 2) >= 350
	})
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := <-exited; err == nil {
		t.Fatal("the replay exited 0 after SIGKILL")
	}
	published := kafkaEnds(t, env, work, 2)
	if published >= n {
		t.Fatalf("%d of %d letters published when the replay was killed: it was not killed part way", published, n)
	}

	r := dlqRun{t: t, flags: flags}
	replayed, copies := summaryCounts(t, r.run(0, "replay", "--all", "--limit", "10000"))
	// The tool commits its progress every 100 letters.
	if again := replayed + int(published) - n; again < 0 || again > 100 {
		t.Errorf("second replay: %d replayed after %d published by the killed run; want the rest of the %d and at most 100 again", replayed, published, n)
	}
	if copies != 0 {
		t.Errorf("second replay removed %d copies, want 0", copies)
	}
	if left := r.count(); left != 0 {
		t.Errorf("%d letters left after the second replay, want 0", left)
	}
	oracle.waitApplied(t, want)
	t.Logf("killed after %d publishes; the second run replayed %d (%d again)", published, replayed, replayed+int(published)-n)
}
