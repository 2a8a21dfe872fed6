package idemkafka_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// failingDeadLetters is a kfake cluster that refuses every produce request
// to the dead-letter topic while fail is set.
type failingDeadLetters struct {
	*kenv
	cluster *kfake.Cluster
	fail    atomic.Bool
	refused atomic.Int64
}

func newFailingDeadLetters(t *testing.T, topic string, partitions int, dlq string) *failingDeadLetters {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(100*time.Millisecond),
		kfake.SeedTopics(int32(partitions), topic), kfake.SeedTopics(1, dlq))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	tr := &kafkago.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	f := &failingDeadLetters{cluster: c, kenv: &kenv{
		brokers: c.ListenAddrs(), session: 10 * time.Second, heartbeat: 100 * time.Millisecond, tr: tr,
		client: &kafkago.Client{Addr: kafkago.TCP(c.ListenAddrs()...), Transport: tr, Timeout: 10 * time.Second},
	}}
	c.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		pr := req.(*kmsg.ProduceRequest)
		if !f.fail.Load() || len(pr.Topics) != 1 || pr.Topics[0].Topic != dlq {
			return nil, nil, false
		}
		f.refused.Add(1)
		resp := pr.ResponseKind().(*kmsg.ProduceResponse)
		for _, tp := range pr.Topics {
			rt := kmsg.NewProduceResponseTopic()
			rt.Topic = tp.Topic
			for _, p := range tp.Partitions {
				rp := kmsg.NewProduceResponseTopicPartition()
				rp.Partition = p.Partition
				rp.ErrorCode = kerr.InvalidRecord.Code // not retried by the Writer
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		return resp, nil, true
	})
	return f
}

// TestOutcomeReportedOnceAfterSettlement: poison records whose dead-letter
// write fails at first, with a rebalance while they wait (a second member
// joins, the first abandons the record it could not park and the group
// hands the partitions out again), are each reported once, after they are
// parked, with the dead letter's reason; good records are reported once
// each as well.
func TestOutcomeReportedOnceAfterSettlement(t *testing.T) {
	topic, dlq := testenv.Name("rep"), testenv.Name("rep_dlq")
	k := newFailingDeadLetters(t, topic, 2, dlq)
	group := testenv.Name("g")

	const poison, good = 16, 40
	var recs []kafkago.Message
	for i := range poison + good {
		id := fmt.Sprintf("good-%d", i)
		if i%((poison+good)/poison) == 0 && i/((poison+good)/poison) < poison {
			id = fmt.Sprintf("poison-%d", i)
		}
		recs = append(recs, rec(i%2, id, id, "v"))
	}
	var nPoison int
	for _, r := range recs {
		if string(r.Key[:6]) == "poison" {
			nPoison++
		}
	}
	if nPoison != poison {
		t.Fatalf("built %d poison records, want %d", nPoison, poison)
	}

	var (
		mu      sync.Mutex
		runs    = map[string]int{}
		reports = map[string][]consumer.Report{}
	)
	errPoison := errors.New("poison")
	h := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		mu.Lock()
		runs[msg.ID]++
		mu.Unlock()
		if msg.ID[:6] == "poison" {
			return consumer.Permanent(errPoison)
		}
		return nil
	})
	opts := idemkafka.ConsumerOptions{
		Backoff:         consumer.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond},
		DeadLetterTopic: dlq,
		CommitInterval:  50 * time.Millisecond,
		Telemetry: consumer.Telemetry{
			Logger: testLogger(t),
			OnOutcome: func(_ context.Context, r consumer.Report) {
				mu.Lock()
				reports[r.Message.ID] = append(reports[r.Message.ID], r)
				mu.Unlock()
			},
		},
	}
	k.fail.Store(true)
	k.produce(t, topic, recs...)
	a, err := idemkafka.NewConsumer(k.readerConfig(group, topic), h, opts)
	if err != nil {
		t.Fatal(err)
	}
	ra := run(t, a)
	eventually(t, 30*time.Second, "dead-letter writes refused", func() bool { return k.refused.Load() >= 4 })

	// A second member: the group rebalances while the first one waits
	// to park a record.
	b, err := idemkafka.NewConsumer(k.readerConfig(group, topic), h, opts)
	if err != nil {
		t.Fatal(err)
	}
	rb := run(t, b)
	eventually(t, 60*time.Second, "a poison record handled again after the rebalance", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for id, n := range runs {
			if id[:6] == "poison" && n > 1 {
				return true
			}
		}
		return false
	})
	k.fail.Store(false)
	ends := k.ends(t, topic, 2)
	eventually(t, 60*time.Second, "all committed", func() bool {
		got := k.committed(t, group, topic, 2)
		return got[0] == ends[0] && got[1] == ends[1]
	})
	ra.stop(t)
	rb.stop(t)

	parked := map[string]int{}
	for _, m := range k.readAll(t, dlq, 1) {
		parked[string(m.Key)]++
		for _, h := range m.Headers {
			if h.Key == consumer.HeaderReason && string(h.Value) != string(consumer.OutcomePermanent) {
				t.Errorf("dead letter of %s: reason %q", m.Key, h.Value)
			}
		}
	}
	mu.Lock()
	defer mu.Unlock()
	total := 0
	for _, r := range recs {
		id := string(r.Key)
		got := reports[id]
		total += len(got)
		if len(got) != 1 {
			t.Errorf("%s: reported %d times (handled %d times)", id, len(got), runs[id])
			continue
		}
		rep := got[0]
		if id[:6] == "poison" {
			if parked[id] == 0 {
				t.Errorf("%s: reported but not in the dead-letter topic", id)
			}
			if rep.Outcome != consumer.OutcomePermanent || rep.Result.Action != consumer.ActionDeadLetter {
				t.Errorf("%s: reported %q, action %v; want permanent, dead_letter", id, rep.Outcome, rep.Result.Action)
			}
		} else if rep.Outcome != consumer.OutcomeCompleted {
			t.Errorf("%s: reported %q, want completed", id, rep.Outcome)
		}
	}
	if total != poison+good {
		t.Errorf("%d reports for %d records (%d poison)", total, poison+good, poison)
	}
}
