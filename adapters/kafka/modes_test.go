package idemkafka_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestKeyWorkers: with several workers per partition, records of one key
// are handled one at a time in offset order, different keys in parallel,
// and every record is committed.
func TestKeyWorkers(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "keys", 2)
	group := testenv.Name("g")
	var recs []kafkago.Message
	for i := range 400 {
		key := "k" + strconv.Itoa(i%10)
		if i%50 == 7 {
			key = "" // records without a key share one
		}
		recs = append(recs, rec(i%2, key, "id-"+strconv.Itoa(i), "v"))
	}
	k.produce(t, topic, recs...)

	type pk struct {
		p   string
		key string
	}
	var (
		mu       sync.Mutex
		last     = map[pk]int64{}
		running  = map[pk]bool{}
		inFlight int
		maxIn    int
		handled  atomic.Int64
	)
	h := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		id := pk{msg.Metadata[idemkafka.MetadataPartition], string(msg.Key)}
		off := offsetOf(t, msg)
		mu.Lock()
		if running[id] {
			t.Errorf("two records of key %q of partition %s at once", id.key, id.p)
		}
		if prev, ok := last[id]; ok && prev >= off {
			t.Errorf("key %q of partition %s: offset %d after %d", id.key, id.p, off, prev)
		}
		running[id] = true
		last[id] = off
		inFlight++
		maxIn = max(maxIn, inFlight)
		mu.Unlock()
		time.Sleep(time.Duration(rand.IntN(500)) * time.Microsecond)
		mu.Lock()
		running[id] = false
		inFlight--
		mu.Unlock()
		handled.Add(1)
		return nil
	})
	c, err := idemkafka.NewConsumer(k.readerConfig(group, topic), h, idemkafka.ConsumerOptions{
		Workers:         4,
		CommitInterval:  20 * time.Millisecond,
		DeadLetterTopic: k.dlq(t, topic),
		Telemetry: consumer.Telemetry{
			Logger: testLogger(t),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	r := run(t, c)
	eventually(t, 30*time.Second, "all committed", func() bool {
		got := k.committed(t, group, topic, 2)
		return got[0] == 200 && got[1] == 200
	})
	r.stop(t)
	if handled.Load() != 400 {
		t.Fatalf("handled %d, want 400", handled.Load())
	}
	mu.Lock()
	defer mu.Unlock()
	if maxIn < 2 {
		t.Errorf("at most %d records ran at once; the workers never overlapped", maxIn)
	}
}

// TestBatchConsumer: a BatchHandler gets the records of a partition in
// offset order, in batches; per-message outcomes (duplicate, poison) are
// acted on, a failing batch is split into single records so that its poison
// record is dead-lettered alone, and PositionAfter says where the partition
// stands.
func TestBatchConsumer(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "batch", 2)
	dlq := k.topic(t, "batch_dlq", 1)
	group := testenv.Name("g")
	var recs []kafkago.Message
	for i := range 300 {
		v := "ok"
		switch i {
		case 40:
			v = "dup"
		case 41, 150:
			v = "poison-in-batch" // reported in a BatchError
		case 99, 201:
			v = "poison" // fails the whole batch
		}
		recs = append(recs, rec(i%2, "k", "id-"+strconv.Itoa(i), v))
	}
	k.produce(t, topic, recs...)

	var (
		mu        sync.Mutex
		done      = map[string]int{}
		sizes     []int
		next      = map[string]int64{}
		positions int
	)
	errPoison := errors.New("cannot parse")
	bh := idemkafka.BatchHandler(func(ctx context.Context, msgs []*consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		sizes = append(sizes, len(msgs))
		be := &idemkafka.BatchError{Errs: map[int]error{}}
		var ok []*consumer.Message
		for i, m := range msgs {
			p := m.Metadata[idemkafka.MetadataPartition]
			if off := offsetOf(t, m); off < next[p] {
				t.Errorf("partition %s: offset %d handed over after %d", p, off, next[p]-1)
			}
			switch string(m.Payload) {
			case "poison":
				if len(msgs) > 1 {
					return errors.New("the batch failed") // nothing committed
				}
				return consumer.Permanent(errPoison)
			case "poison-in-batch":
				be.Errs[i] = consumer.Permanent(errPoison)
			case "dup":
				be.Errs[i] = &dedup.ClaimError{Err: dedup.ErrDuplicate, Key: dedup.Key{Scope: "s", ID: m.ID}}
				ok = append(ok, m)
			default:
				ok = append(ok, m)
			}
		}
		for _, m := range ok {
			done[m.ID]++
			next[m.Metadata[idemkafka.MetadataPartition]] = offsetOf(t, m) + 1
		}
		if pos, found := idemkafka.PositionAfter(ctx, ok...); found {
			positions++
			if pos.Group != group || pos.Topic != topic {
				t.Errorf("position %+v", pos)
			}
		}
		if len(be.Errs) > 0 {
			return be
		}
		return nil
	})
	c, err := idemkafka.NewBatchConsumer(k.readerConfig(group, topic), bh, idemkafka.ConsumerOptions{
		BatchSize:       16,
		DeadLetterTopic: dlq,
		Telemetry: consumer.Telemetry{
			Logger: testLogger(t),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	r := run(t, c)
	eventually(t, 30*time.Second, "all committed", func() bool {
		got := k.committed(t, group, topic, 2)
		return got[0] == 150 && got[1] == 150
	})
	r.stop(t)

	mu.Lock()
	defer mu.Unlock()
	for i := range 300 {
		id := "id-" + strconv.Itoa(i)
		want := 1
		switch i {
		case 41, 150, 99, 201:
			want = 0
		}
		if done[id] != want {
			t.Errorf("%s done %d times, want %d", id, done[id], want)
		}
	}
	if positions == 0 {
		t.Error("PositionAfter never answered")
	}
	var multi bool
	for _, s := range sizes {
		multi = multi || s > 1
		if s > 16 {
			t.Errorf("a batch of %d, above BatchSize 16", s)
		}
	}
	if !multi {
		t.Error("every batch had one record")
	}
	reasons := map[string]int{}
	for _, m := range k.readAll(t, dlq, 1) {
		for _, h := range m.Headers {
			if h.Key == consumer.HeaderReason {
				reasons[string(h.Value)]++
			}
		}
	}
	if reasons[string(consumer.OutcomePermanent)] != 4 || len(reasons) != 1 {
		t.Errorf("dead letters by reason %v, want 4 permanent", reasons)
	}
}

// TestPositionAfterOutsideConsumer: no position outside a Consumer's
// handler.
func TestPositionAfterOutsideConsumer(t *testing.T) {
	if _, ok := idemkafka.PositionAfter(context.Background()); ok {
		t.Fatal("PositionAfter answered outside a Consumer")
	}
}

// TestBatchDeadLettersOnce: records without an id in a batch that a
// rebalance cuts short are dead-lettered once, by the member that finishes
// the partition, not once by each member; and every dead letter carries
// the id "topic/partition/offset" of its record.
func TestBatchDeadLettersOnce(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "batchdl", 1)
	dlq := k.dlq(t, topic)
	group := testenv.Name("g")
	const n = 10
	invalid := map[int64]bool{5: true, 8: true}
	var recs []kafkago.Message
	for i := range n {
		id := "id-" + strconv.Itoa(i)
		if invalid[int64(i)] {
			id = "" // no id header: dead-lettered without reaching the handler
		}
		recs = append(recs, rec(0, "k", id, "v"+strconv.Itoa(i)))
	}
	k.produce(t, topic, recs...)

	// Member A: a batch without a record missing from its offsets waits
	// until every record was queued (so that the next batch holds all the
	// rest), and commits. A batch with a hole (a record without an id was
	// in it) runs until the generation ends, as one a rebalance cuts
	// short, and fails.
	queued, cut := make(chan struct{}), make(chan struct{})
	var cutOnce sync.Once
	bhA := idemkafka.BatchHandler(func(ctx context.Context, msgs []*consumer.Message) error {
		for i := 1; i < len(msgs); i++ {
			if offsetOf(t, msgs[i]) != offsetOf(t, msgs[i-1])+1 {
				cutOnce.Do(func() { close(cut) })
				<-ctx.Done()
				return ctx.Err()
			}
		}
		select {
		case <-queued:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	opts := idemkafka.ConsumerOptions{
		DeadLetterTopic: dlq,
		CommitInterval:  20 * time.Millisecond,
		ShutdownTimeout: 100 * time.Millisecond,
		Telemetry: consumer.Telemetry{
			Logger: testLogger(t),
		},
	}
	a, err := idemkafka.NewBatchConsumer(k.readerConfig(group, topic), bhA, opts)
	if err != nil {
		t.Fatal(err)
	}
	idemkafka.SetQueued(a, func(km *kafkago.Message) {
		if km.Offset == n-1 {
			close(queued)
		}
	})
	ra := run(t, a)
	select {
	case <-cut:
	case <-time.After(30 * time.Second):
		t.Fatal("no batch with a record without an id")
	}
	ra.stop(t)

	// Member B finishes the partition.
	var handled atomic.Int64
	b, err := idemkafka.NewBatchConsumer(k.readerConfig(group, topic), idemkafka.BatchHandler(func(_ context.Context, msgs []*consumer.Message) error {
		handled.Add(int64(len(msgs)))
		return nil
	}), opts)
	if err != nil {
		t.Fatal(err)
	}
	rb := run(t, b)
	eventually(t, 30*time.Second, "all committed", func() bool { return k.committed(t, group, topic, 1)[0] == n })
	rb.stop(t)

	byOffset := map[string][]string{}
	for _, m := range k.readAll(t, dlq, 1) {
		hs := map[string]string{}
		for _, h := range m.Headers {
			hs[h.Key] = string(h.Value)
		}
		byOffset[hs[idemkafka.HeaderOffset]] = append(byOffset[hs[idemkafka.HeaderOffset]], hs[consumer.HeaderID])
	}
	for off := range invalid {
		o := strconv.FormatInt(off, 10)
		want := topic + "/0/" + o
		if got := byOffset[o]; len(got) != 1 || got[0] != want {
			t.Errorf("offset %d: dead letters with ids %q, want one with %q", off, got, want)
		}
	}
	if len(byOffset) != len(invalid) {
		t.Errorf("dead letters of offsets %v, want %v", byOffset, invalid)
	}
}
