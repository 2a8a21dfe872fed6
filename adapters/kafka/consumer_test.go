package idemkafka_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

func offsetOf(t testing.TB, msg *consumer.Message) int64 {
	t.Helper()
	o, err := strconv.ParseInt(msg.Metadata[idemkafka.MetadataOffset], 10, 64)
	if err != nil {
		t.Errorf("metadata offset: %v", err)
	}
	return o
}

// TestCommitOrder: with 8 workers on one partition, a slow record at offset 5
// holds the committed offset at 5 while 6..100 finish; once it finishes the
// offset moves to the end.
func TestCommitOrder(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "order", 1)
	group := testenv.Name("g")
	var recs []kafkago.Message
	for i := range 101 {
		recs = append(recs, rec(0, "key-"+strconv.Itoa(i), "id-"+strconv.Itoa(i), "v"))
	}
	k.produce(t, topic, recs...)

	release := make(chan struct{})
	var (
		hmu     sync.Mutex
		handled = map[int64]bool{} // by offset: a redelivery is not counted twice
	)
	count := func() int {
		hmu.Lock()
		defer hmu.Unlock()
		return len(handled)
	}
	h := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		o := offsetOf(t, msg)
		if o == 5 {
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		hmu.Lock()
		handled[o] = true
		hmu.Unlock()
		return nil
	})
	c, err := idemkafka.NewConsumer(k.readerConfig(group, topic), h, idemkafka.ConsumerOptions{
		Workers:         8,
		CommitEvery:     10,
		CommitInterval:  20 * time.Millisecond,
		DeadLetterTopic: k.dlq(t, topic),
		Telemetry: consumer.Telemetry{
			Logger: testLogger(t),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu      sync.Mutex
		commits []int64
	)
	idemkafka.SetCommitHooks(c, nil, func(offsets map[string]map[int]int64) {
		mu.Lock()
		commits = append(commits, offsets[topic][0])
		mu.Unlock()
	})
	r := run(t, c)

	eventually(t, 30*time.Second, "offsets 0-4 and 6-100 handled", func() bool { return count() == 100 })
	eventually(t, 30*time.Second, "offset 5 committed", func() bool { return k.committed(t, group, topic, 1)[0] == 5 })
	// Everything after 5 is done, and commits keep being attempted every
	// 20ms: none may pass the unfinished record.
	time.Sleep(100 * time.Millisecond)
	if got := k.committed(t, group, topic, 1)[0]; got != 5 {
		t.Fatalf("committed offset %d while offset 5 is unfinished; want 5", got)
	}
	mu.Lock()
	for _, o := range commits {
		if o > 5 {
			t.Errorf("a commit of %d happened while offset 5 was unfinished", o)
		}
	}
	mu.Unlock()

	close(release)
	eventually(t, 30*time.Second, "offset 101 committed", func() bool { return k.committed(t, group, topic, 1)[0] == 101 })
	r.stop(t)
	if n := count(); n != 101 {
		t.Fatalf("handled %d offsets, want 101", n)
	}
}

// TestRetryInPlaceKeepsOrder: a transient error is retried in place, with
// the partition waiting, so records are handled in offset order exactly,
// and reported once each, when acknowledged.
func TestRetryInPlaceKeepsOrder(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "retry", 1)
	group := testenv.Name("g")
	var recs []kafkago.Message
	for i := range 20 {
		recs = append(recs, rec(0, "k", "id-"+strconv.Itoa(i), "v"))
	}
	k.produce(t, topic, recs...)

	var (
		mu    sync.Mutex
		order []int64
		fails int
	)
	errFlaky := errors.New("flaky downstream")
	h := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		o := offsetOf(t, msg)
		order = append(order, o)
		if o == 7 && fails < 3 {
			fails++
			if msg.Attempt != fails {
				t.Errorf("attempt %d on failure %d", msg.Attempt, fails)
			}
			return errFlaky
		}
		return nil
	})
	var reports, retries atomic.Int64
	c, err := idemkafka.NewConsumer(k.readerConfig(group, topic), h, idemkafka.ConsumerOptions{
		Backoff:         consumer.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
		DeadLetterTopic: k.dlq(t, topic),
		Telemetry: consumer.Telemetry{
			Logger: testLogger(t),
			OnOutcome: func(_ context.Context, rep consumer.Report) {
				reports.Add(1)
				if rep.Result.Action == consumer.ActionRetry {
					retries.Add(1)
				}
			},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	r := run(t, c)
	eventually(t, 30*time.Second, "all committed", func() bool { return k.committed(t, group, topic, 1)[0] == 20 })
	r.stop(t)

	want := []int64{0, 1, 2, 3, 4, 5, 6, 7, 7, 7, 7}
	for i := int64(8); i < 20; i++ {
		want = append(want, i)
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(order) != fmt.Sprint(want) {
		t.Fatalf("handling order\n got %v\nwant %v", order, want)
	}
	// A retry settles nothing: each record is reported once, when it is
	// acknowledged.
	if reports.Load() != 20 || retries.Load() != 0 {
		t.Fatalf("%d reports, %d of them retries; want 20, none", reports.Load(), retries.Load())
	}
}

// TestPoisonToDeadLetter: poison records of every kind go to the dead-letter
// topic with the reason and the original position, and the partition goes
// on; every good record is handled once and the offsets reach the end.
func TestPoisonToDeadLetter(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "poison", 2)
	dlq := k.topic(t, "poison_dlq", 1)
	group := testenv.Name("g")

	type poison struct {
		rec    kafkago.Message
		reason consumer.Outcome
	}
	bad := []poison{
		{rec(0, "a", "", "no id header"), consumer.OutcomeInvalidKey},
		{rec(1, "b", "bad\x01id", "control byte in the id"), consumer.OutcomeInvalidKey},
		{rec(0, "c", string(make([]byte, 300)), "id too long"), consumer.OutcomeInvalidKey},
		{rec(1, "d", "perm-1", "permanent"), consumer.OutcomePermanent},
		{rec(0, "e", "panic-1", "panic"), consumer.OutcomePanic},
		{rec(1, "f", "flaky-1", "always transient"), consumer.OutcomeRetriesExhausted},
		// In good-3's partition, after it.
		{rec(1, "g", "good-3", "same id as good-3, other payload"), consumer.OutcomeFingerprintMismatch},
	}
	var recs []kafkago.Message
	good := map[string]bool{}
	for i := range 6 * len(bad) {
		id := "good-" + strconv.Itoa(i)
		good[id] = true
		recs = append(recs, rec(i%2, "k"+strconv.Itoa(i), id, "payload-"+id))
		if i%6 == 5 {
			recs = append(recs, bad[i/6].rec)
		}
	}
	k.produce(t, topic, recs...)

	store, err := memstore.New(memstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "test/poison"})
	if err != nil {
		t.Fatal(err)
	}
	retry, err := consumer.Retry(consumer.RetryOptions{MaxAttempts: 3, Backoff: consumer.Backoff{Initial: time.Millisecond, Max: 2 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu      sync.Mutex
		effects = map[string]int{}
	)
	h := consumer.Chain(consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		switch string(msg.Payload) {
		case "permanent":
			return consumer.Permanent(errors.New("cannot parse"))
		case "panic":
			panic("boom")
		case "always transient":
			return errors.New("downstream unavailable")
		}
		mu.Lock()
		effects[msg.ID]++
		mu.Unlock()
		return nil
	}), retry, consumer.Recover(), dd)

	c, err := idemkafka.NewConsumer(k.readerConfig(group, topic), h, idemkafka.ConsumerOptions{
		DeadLetterTopic: dlq,
		Backoff:         consumer.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
		Telemetry: consumer.Telemetry{
			Logger: testLogger(t),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	r := run(t, c)
	ends := k.ends(t, topic, 2)
	eventually(t, 30*time.Second, "all committed", func() bool {
		got := k.committed(t, group, topic, 2)
		return got[0] == ends[0] && got[1] == ends[1]
	})
	r.stop(t)

	mu.Lock()
	for id := range good {
		if effects[id] != 1 {
			t.Errorf("%s applied %d times, want 1", id, effects[id])
		}
	}
	if len(effects) != len(good) {
		t.Errorf("%d ids applied, want %d", len(effects), len(good))
	}
	mu.Unlock()

	// The originals, by payload, to check the position headers.
	orig := map[string]kafkago.Message{}
	for _, m := range k.readAll(t, topic, 2) {
		orig[string(m.Value)] = m
	}
	got := k.readAll(t, dlq, 1)
	if len(got) != len(bad) {
		t.Fatalf("%d dead letters, want %d", len(got), len(bad))
	}
	byPayload := map[string]kafkago.Message{}
	for _, m := range got {
		byPayload[string(m.Value)] = m
	}
	for _, b := range bad {
		m, ok := byPayload[string(b.rec.Value)]
		if !ok {
			t.Errorf("%q not dead-lettered", b.rec.Value)
			continue
		}
		hs := map[string]string{}
		for _, h := range m.Headers {
			hs[h.Key] = string(h.Value)
		}
		o := orig[string(b.rec.Value)]
		if hs[consumer.HeaderReason] != string(b.reason) {
			t.Errorf("%q: reason %q, want %q", b.rec.Value, hs[consumer.HeaderReason], b.reason)
		}
		if hs[consumer.HeaderSource] != topic || hs[idemkafka.HeaderPartition] != strconv.Itoa(o.Partition) || hs[idemkafka.HeaderOffset] != strconv.FormatInt(o.Offset, 10) {
			t.Errorf("%q: position headers %s/%s/%s, want %s/%d/%d", b.rec.Value,
				hs[consumer.HeaderSource], hs[idemkafka.HeaderPartition], hs[idemkafka.HeaderOffset], topic, o.Partition, o.Offset)
		}
		if want := fmt.Sprintf("%s/%d/%d", topic, o.Partition, o.Offset); hs[consumer.HeaderID] != want {
			t.Errorf("%q: dead-letter id %q, want %q", b.rec.Value, hs[consumer.HeaderID], want)
		}
		if hs[consumer.HeaderError] == "" || hs[idemkafka.HeaderGroup] != group || string(m.Key) != string(b.rec.Key) {
			t.Errorf("%q: error %q, group %q, key %q", b.rec.Value, hs[consumer.HeaderError], hs[idemkafka.HeaderGroup], m.Key)
		}
		wantAttempts := "1"
		if b.reason == consumer.OutcomeRetriesExhausted {
			wantAttempts = "3"
		}
		if hs[consumer.HeaderAttempts] != wantAttempts {
			t.Errorf("%q: attempts %q, want %s", b.rec.Value, hs[consumer.HeaderAttempts], wantAttempts)
		}
		if id := hs[outbox.HeaderMessageID]; len(b.rec.Headers) > 0 && id != string(b.rec.Headers[0].Value) {
			t.Errorf("%q: the id header was not kept: %q", b.rec.Value, id)
		}
	}
}

// TestDeadLetterTopicMissing: Run checks the dead-letter topic before it
// consumes anything. One that does not exist is an error naming it, at once,
// not a partition that stalls at its first poison record.
func TestDeadLetterTopicMissing(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "nodlq", 1)
	k.produce(t, topic, rec(0, "k", "", "poison: no id"), rec(0, "k", "id-1", "v"))
	missing := topic + "_missing_dlq"
	var handled atomic.Int64
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		handled.Add(1)
		return nil
	})
	for _, opts := range []idemkafka.ConsumerOptions{
		{DeadLetterTopic: missing},
		{DeadLetterWriter: &kafkago.Writer{Addr: kafkago.TCP(k.brokers...), Topic: missing, RequiredAcks: kafkago.RequireAll, Transport: k.tr}},
	} {
		opts.Logger = testLogger(t)
		c, err := idemkafka.NewConsumer(k.readerConfig(testenv.Name("g"), topic), h, opts)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err = c.Run(ctx)
		cancel()
		if !errors.Is(err, idemkafka.ErrDeadLetterTopicMissing) || !strings.Contains(err.Error(), strconv.Quote(missing)) {
			t.Fatalf("Run = %v; want ErrDeadLetterTopicMissing naming %q", err, missing)
		}
		t.Log(err)
	}
	if n := handled.Load(); n != 0 {
		t.Fatalf("%d records handled without a dead-letter topic", n)
	}
}

// TestProducerDuplicates: the same id produced again at later offsets (a
// relay re-publish) is applied once.
func TestProducerDuplicates(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "dups", 3)
	group := testenv.Name("g")
	all := ids("m", 300)
	var recs []kafkago.Message
	for i, id := range all {
		recs = append(recs, rec(i%3, id, id, "payload-"+id))
	}
	// 60 re-publishes: the same key (same partition) and a few to other
	// partitions, all later in their partition.
	for i := range 60 {
		id := all[i*5]
		p := (i * 5) % 3
		if i%4 == 0 {
			p = (p + 1) % 3
		}
		recs = append(recs, rec(p, id, id, "payload-"+id))
	}
	k.produce(t, topic, recs...)

	store, err := memstore.New(memstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "test/dups"})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu      sync.Mutex
		effects = map[string]int{}
		dupes   atomic.Int64
	)
	h := consumer.Chain(consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		mu.Lock()
		effects[msg.ID]++
		mu.Unlock()
		return nil
	}), dd)
	c, err := idemkafka.NewConsumer(k.readerConfig(group, topic), h, idemkafka.ConsumerOptions{
		DeadLetterTopic: k.dlq(t, topic),
		CommitInterval:  50 * time.Millisecond,
		Telemetry: consumer.Telemetry{
			Logger: testLogger(t),
			OnOutcome: func(_ context.Context, rep consumer.Report) {
				r := rep.Result
				if r.Duplicate {
					dupes.Add(1)
				}
			},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	r := run(t, c)
	ends := k.ends(t, topic, 3)
	eventually(t, 30*time.Second, "all committed", func() bool {
		got := k.committed(t, group, topic, 3)
		return got[0] == ends[0] && got[1] == ends[1] && got[2] == ends[2]
	})
	r.stop(t)
	mu.Lock()
	defer mu.Unlock()
	extra, lost := 0, 0
	for _, id := range all {
		switch n := effects[id]; {
		case n == 0:
			lost++
		case n > 1:
			extra += n - 1
		}
	}
	if extra != 0 || lost != 0 || len(effects) != len(all) {
		t.Fatalf("%d ids: %d extra effects, %d lost, %d distinct applied", len(all), extra, lost, len(effects))
	}
	if dupes.Load() != 60 {
		t.Fatalf("%d duplicates acknowledged, want 60", dupes.Load())
	}
}

// TestMessageMapping: id, key, payload, headers, topic, partition, offset,
// group and time reach the handler; OffsetID gives a record without an id
// header the id topic/partition/offset.
func TestMessageMapping(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "mapping", 2)
	group := testenv.Name("g")
	at := time.Now().Add(-time.Hour).Truncate(time.Millisecond)
	withID := rec(1, "the-key", "the-id", "the-payload")
	withID.Headers = append(withID.Headers, kafkago.Header{Key: "h1", Value: []byte("v1")})
	withID.Time = at
	noID := rec(1, "other", "", "no id")
	k.produce(t, topic, withID, noID)

	got := make(chan *consumer.Message, 2)
	h := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		got <- msg
		return nil
	})
	c, err := idemkafka.NewConsumer(k.readerConfig(group, topic), h, idemkafka.ConsumerOptions{OffsetID: true, DeadLetterTopic: k.dlq(t, topic)})
	if err != nil {
		t.Fatal(err)
	}
	r := run(t, c)
	var msgs []*consumer.Message
	for range 2 {
		select {
		case m := <-got:
			msgs = append(msgs, m)
		case <-time.After(30 * time.Second):
			t.Fatal("records not handled")
		}
	}
	r.stop(t)
	m := msgs[0]
	if m.ID != "the-id" || string(m.Key) != "the-key" || string(m.Payload) != "the-payload" || m.Topic != topic ||
		m.Headers["h1"] != "v1" || m.Headers[outbox.HeaderMessageID] != "the-id" || !m.Time.Equal(at) || m.Attempt != 1 ||
		m.Metadata[idemkafka.MetadataPartition] != "1" || m.Metadata[idemkafka.MetadataOffset] != "0" || m.Metadata[idemkafka.MetadataGroup] != group {
		t.Errorf("mapped message: %+v", m)
	}
	if want := topic + "/1/1"; msgs[1].ID != want {
		t.Errorf("OffsetID: id %q, want %q", msgs[1].ID, want)
	}
}

// TestIDFunc: an id taken from the payload; a record it refuses is
// dead-lettered as invalid_key.
func TestIDFunc(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "idfunc", 1)
	dlq := k.topic(t, "idfunc_dlq", 1)
	group := testenv.Name("g")
	k.produce(t, topic, rec(0, "k", "", "order=7"), rec(0, "k", "", "garbage"), rec(0, "k", "", "order=8"))
	var (
		mu  sync.Mutex
		got []string
	)
	h := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		mu.Lock()
		got = append(got, msg.ID)
		mu.Unlock()
		return nil
	})
	c, err := idemkafka.NewConsumer(k.readerConfig(group, topic), h, idemkafka.ConsumerOptions{
		DeadLetterTopic: dlq,
		IDFunc: func(km *kafkago.Message) (string, error) {
			id, ok := strings.CutPrefix(string(km.Value), "order=")
			if !ok {
				return "", errors.New("no order number")
			}
			return "order-" + id, nil
		},
		Telemetry: consumer.Telemetry{
			Logger: testLogger(t),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	r := run(t, c)
	eventually(t, 30*time.Second, "all committed", func() bool { return k.committed(t, group, topic, 1)[0] == 3 })
	r.stop(t)
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(got) != "[order-7 order-8]" {
		t.Fatalf("handled %v", got)
	}
	dl := k.readAll(t, dlq, 1)
	if len(dl) != 1 || string(dl[0].Value) != "garbage" {
		t.Fatalf("dead letters %v", dl)
	}
	for _, h := range dl[0].Headers {
		if h.Key == consumer.HeaderReason && string(h.Value) != string(consumer.OutcomeInvalidKey) {
			t.Fatalf("reason %s", h.Value)
		}
	}
}

// TestShutdownCommitsDone: stopping commits what is done, even with commits
// otherwise never due, and leaves the group.
func TestShutdownCommitsDone(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "shutdown", 2)
	group := testenv.Name("g")
	var recs []kafkago.Message
	for i, id := range ids("s", 50) {
		recs = append(recs, rec(i%2, id, id, "v"))
	}
	k.produce(t, topic, recs...)
	var handled atomic.Int64
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { handled.Add(1); return nil })
	c, err := idemkafka.NewConsumer(k.readerConfig(group, topic), h, idemkafka.ConsumerOptions{
		CommitEvery:     1 << 30,
		CommitInterval:  time.Hour,
		DeadLetterTopic: k.dlq(t, topic),
		Telemetry: consumer.Telemetry{
			Logger: testLogger(t),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	r := run(t, c)
	eventually(t, 30*time.Second, "all handled", func() bool { return handled.Load() == 50 })
	if got := k.committed(t, group, topic, 2); got[0] > 0 || got[1] > 0 {
		t.Fatalf("committed %v before the stop, with no commit due", got)
	}
	r.stop(t)
	if got := k.committed(t, group, topic, 2); got[0] != 25 || got[1] != 25 {
		t.Fatalf("committed %v after the stop, want [25 25]", got)
	}
}

func TestNewConsumerValidation(t *testing.T) {
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	cfg := kafkago.ReaderConfig{Brokers: []string{"127.0.0.1:1"}, GroupID: "g", Topic: "t"}
	ok := idemkafka.ConsumerOptions{DeadLetterTopic: "t.dlq"}
	for _, tc := range []struct {
		name string
		cfg  func(*kafkago.ReaderConfig)
		opts func(*idemkafka.ConsumerOptions)
	}{
		{"no group", func(c *kafkago.ReaderConfig) { c.GroupID = "" }, nil},
		{"no brokers", func(c *kafkago.ReaderConfig) { c.Brokers = nil }, nil},
		{"no topic", func(c *kafkago.ReaderConfig) { c.Topic = "" }, nil},
		{"partition", func(c *kafkago.ReaderConfig) { c.Partition = 3 }, nil},
		{"commit interval", func(c *kafkago.ReaderConfig) { c.CommitInterval = time.Second }, nil},
		{"both topics", func(c *kafkago.ReaderConfig) { c.GroupTopics = []string{"u"} }, nil},
		{"no dead-letter topic", nil, func(o *idemkafka.ConsumerOptions) { o.DeadLetterTopic = "" }},
		{"dead-letter topic is read", nil, func(o *idemkafka.ConsumerOptions) { o.DeadLetterTopic = "t" }},
		{"negative workers", nil, func(o *idemkafka.ConsumerOptions) { o.Workers = -1 }},
		{"async dead-letter writer", nil, func(o *idemkafka.ConsumerOptions) {
			o.DeadLetterWriter = &kafkago.Writer{Addr: kafkago.TCP("x"), Async: true, RequiredAcks: kafkago.RequireAll}
		}},
		{"dead-letter writer without acks", nil, func(o *idemkafka.ConsumerOptions) {
			o.DeadLetterWriter = &kafkago.Writer{Addr: kafkago.TCP("x")}
		}},
		{"read backoff min above the default max", func(c *kafkago.ReaderConfig) { c.ReadBackoffMin = 2 * time.Second }, nil},
		{"backoff initial above max", nil, func(o *idemkafka.ConsumerOptions) {
			o.Backoff = consumer.Backoff{Initial: time.Second, Max: time.Millisecond}
		}},
	} {
		c, o := cfg, ok
		if tc.cfg != nil {
			tc.cfg(&c)
		}
		if tc.opts != nil {
			tc.opts(&o)
		}
		if _, err := idemkafka.NewConsumer(c, h, o); err == nil {
			t.Errorf("%s: NewConsumer accepted it", tc.name)
		}
	}
	if _, err := idemkafka.NewConsumer(cfg, nil, ok); err == nil {
		t.Error("nil handler accepted")
	}
	bh := idemkafka.BatchHandler(func(context.Context, []*consumer.Message) error { return nil })
	if _, err := idemkafka.NewBatchConsumer(cfg, bh, idemkafka.ConsumerOptions{DeadLetterTopic: "d", Workers: 2}); err == nil {
		t.Error("batch consumer with 2 workers accepted")
	}
	if _, err := idemkafka.NewConsumer(cfg, h, ok); err != nil {
		t.Errorf("valid config refused: %v", err)
	}
}

// TestStartAtLastOffset: a group without committed offsets and StartOffset
// LastOffset starts at the end, and records that start right away, so that
// records produced before the next generation are not skipped (kafka-go
// issue #1319).
func TestStartAtLastOffset(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "last", 1)
	group := testenv.Name("g")
	k.produce(t, topic, rec(0, "k", "old-1", "v"), rec(0, "k", "old-2", "v"))
	var (
		mu   sync.Mutex
		seen []string
	)
	h := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		mu.Lock()
		seen = append(seen, msg.ID)
		mu.Unlock()
		return nil
	})
	cfg := k.readerConfig(group, topic)
	cfg.StartOffset = kafkago.LastOffset
	dlq := k.dlq(t, topic)
	c, err := idemkafka.NewConsumer(cfg, h, idemkafka.ConsumerOptions{DeadLetterTopic: dlq, CommitInterval: 20 * time.Millisecond, Telemetry: consumer.Telemetry{Logger: testLogger(t)}})
	if err != nil {
		t.Fatal(err)
	}
	r := run(t, c)
	eventually(t, 30*time.Second, "the start position committed", func() bool { return k.committed(t, group, topic, 1)[0] == 2 })
	r.stop(t)
	k.produce(t, topic, rec(0, "k", "new-1", "v"))

	c2, err := idemkafka.NewConsumer(cfg, h, idemkafka.ConsumerOptions{DeadLetterTopic: dlq, CommitInterval: 20 * time.Millisecond, Telemetry: consumer.Telemetry{Logger: testLogger(t)}})
	if err != nil {
		t.Fatal(err)
	}
	r2 := run(t, c2)
	eventually(t, 30*time.Second, "new-1 committed", func() bool { return k.committed(t, group, topic, 1)[0] == 3 })
	r2.stop(t)
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(seen) != "[new-1]" {
		t.Fatalf("handled %v, want [new-1]", seen)
	}
}
