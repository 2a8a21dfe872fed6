package idemkafka_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// outboxHeaders starts a span, as the request that calls outbox.Enqueue
// would, and returns it with the headers the outbox stores for a message
// enqueued under it: the W3C traceparent in outbox.HeaderTraceParent.
func outboxHeaders(t *testing.T, tp trace.TracerProvider) (trace.Span, map[string]string) {
	t.Helper()
	ctx, span := tp.Tracer("test").Start(context.Background(), "enqueue")
	h := map[string]string{"content-type": "text/plain"}
	propagation.TraceContext{}.Inject(ctx, propagation.MapCarrier(h))
	if h[outbox.HeaderTraceParent] == "" {
		t.Fatalf("no %s header injected: %v", outbox.HeaderTraceParent, h)
	}
	span.End()
	return span, h
}

// spanAttr returns the value of key on s.
func spanAttr(s sdktrace.ReadOnlySpan, key attribute.Key) (attribute.Value, bool) {
	for _, kv := range s.Attributes() {
		if kv.Key == key {
			return kv.Value, true
		}
	}
	return attribute.Value{}, false
}

// A trace started before the outbox stored the message is the parent of the
// consumer's span after a trip through the Publisher the relay uses and
// Kafka, and the Dedup claim runs under the consumer's span.
func TestConsumerContinuesOutboxTrace(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "trace", 1)
	spans := telemetrytest.NewSpans(t)
	producer, headers := outboxHeaders(t, spans)

	pub, err := idemkafka.NewPublisher(k.writer(t, topic), idemkafka.PublisherOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(t.Context(), []*outbox.Message{{ID: "order-7", Key: []byte("k"), Payload: []byte("p"), Headers: headers}}); err != nil {
		t.Fatal(err)
	}

	store, err := memstore.New(memstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = store.Close() })
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "test/trace", Telemetry: consumer.Telemetry{TracerProvider: spans}})
	if err != nil {
		t.Fatal(err)
	}
	var handlerTrace atomic.Value
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
		handlerTrace.Store(trace.SpanContextFromContext(ctx))
		return nil
	}), dd)
	c, err := idemkafka.NewConsumer(k.readerConfig(testenv.Name("g"), topic), h, idemkafka.ConsumerOptions{
		DeadLetterTopic: k.dlq(t, topic),
		Telemetry: consumer.Telemetry{
			TracerProvider: spans,
			Logger:         testLogger(t),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	run(t, c)

	cs := spans.Wait(t, "process "+topic, 1)[0]
	pc := producer.SpanContext()
	if cs.Parent().TraceID() != pc.TraceID() || cs.Parent().SpanID() != pc.SpanID() || !cs.Parent().IsRemote() {
		t.Fatalf("consumer span's parent = %v/%v (remote %v), want the producer's %v/%v",
			cs.Parent().TraceID(), cs.Parent().SpanID(), cs.Parent().IsRemote(), pc.TraceID(), pc.SpanID())
	}
	if cs.SpanKind() != trace.SpanKindConsumer {
		t.Errorf("span kind = %v, want consumer", cs.SpanKind())
	}
	for key, want := range map[attribute.Key]string{
		telemetry.AttrSystem: "kafka", telemetry.AttrDestination: topic, telemetry.AttrResult: "ack",
	} {
		if v, _ := spanAttr(cs, key); v.AsString() != want {
			t.Errorf("span attribute %s = %q, want %q", key, v.AsString(), want)
		}
	}
	if v, ok := spanAttr(cs, "messaging.kafka.offset"); !ok || v.AsInt64() != 0 {
		t.Errorf("span attribute messaging.kafka.offset = %v (%v), want 0", v.AsInt64(), ok)
	}
	claim := spans.Wait(t, "idem.claim", 1)[0]
	if claim.Parent().SpanID() != cs.SpanContext().SpanID() || claim.SpanContext().TraceID() != pc.TraceID() {
		t.Errorf("idem.claim's parent = %v, want the consumer span %v", claim.Parent().SpanID(), cs.SpanContext().SpanID())
	}
	if sc, _ := handlerTrace.Load().(trace.SpanContext); sc.TraceID() != pc.TraceID() {
		t.Errorf("the handler's trace = %v, want %v", sc.TraceID(), pc.TraceID())
	}
}

// Each verdict is counted with the system, topic, result and dead-letter
// reason, and nothing holds a message id: no metric attribute, no log line.
func TestConsumerMetricsByVerdict(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "verdicts", 1)
	dlq := k.topic(t, "verdicts_dlq", 1)
	k.produce(t, topic,
		rec(0, "secret-key-1", "secret-id-ok", "a"),
		rec(0, "secret-key-2", "secret-id-flaky", "b"),
		rec(0, "secret-key-3", "secret-id-poison", "c"),
		rec(0, "secret-key-4", "", "no id"),
	)
	mp := telemetrytest.NewMetrics(t)
	var flaked atomic.Bool
	h := consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		switch m.ID {
		case "secret-id-flaky":
			if flaked.CompareAndSwap(false, true) {
				return errors.New("not yet")
			}
		case "secret-id-poison":
			return consumer.Permanent(errors.New("poison"))
		}
		return nil
	})
	var logs telemetrytest.LogBuffer
	c, err := idemkafka.NewConsumer(k.readerConfig(testenv.Name("g"), topic), h, idemkafka.ConsumerOptions{
		DeadLetterTopic: dlq,
		Backoff:         consumer.Backoff{Initial: time.Millisecond, Max: 10 * time.Millisecond},
		Telemetry: consumer.Telemetry{
			MeterProvider: mp,
			Logger:        slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	run(t, c)
	eventually(t, 30*time.Second, "5 verdicts", func() bool { return mp.Sum(telemetry.MetricMessages) >= 5 })

	mp.CheckVerdicts("kafka", topic, 5,
		telemetrytest.Verdict{Result: "ack", Want: 2},
		telemetrytest.Verdict{Result: "retry", Want: 1},
		telemetrytest.Verdict{Result: "dead_letter", Reason: string(consumer.OutcomePermanent), Want: 1},
		telemetrytest.Verdict{Result: "dead_letter", Reason: string(consumer.OutcomeInvalidKey), Want: 1})
	mp.NoValueContains("secret-")
	eventually(t, 10*time.Second, "the dead-letter log lines", func() bool {
		return strings.Count(logs.String(), "record dead-lettered") == 2
	})
	if strings.Contains(logs.String(), "secret-") {
		t.Errorf("a log line holds a raw id or key:\n%s", logs.String())
	}
	if !strings.Contains(logs.String(), "message_id_hash=") {
		t.Errorf("no message_id_hash in the logs:\n%s", logs.String())
	}
}

// A batch has one span with a link to each record's trace, and its
// records' verdicts are counted.
func TestBatchConsumerLinksTraces(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "batchtrace", 1)
	spans := telemetrytest.NewSpans(t)
	mp := telemetrytest.NewMetrics(t)
	const n = 3
	var producers []trace.SpanContext
	recs := make([]kafkago.Message, n)
	for i := range recs {
		sp, h := outboxHeaders(t, spans)
		producers = append(producers, sp.SpanContext())
		recs[i] = rec(0, "k", ids("b", n)[i], "v")
		recs[i].Headers = append(recs[i].Headers, kafkago.Header{Key: outbox.HeaderTraceParent, Value: []byte(h[outbox.HeaderTraceParent])})
	}
	k.produce(t, topic, recs...)
	// The batch handler waits until every record is fetched, so that they
	// arrive as one batch.
	var calls atomic.Int64
	bh := idemkafka.BatchHandler(func(ctx context.Context, msgs []*consumer.Message) error {
		calls.Add(1)
		if !trace.SpanFromContext(ctx).SpanContext().IsValid() {
			return errors.New("no span in the batch's context")
		}
		return nil
	})
	c, err := idemkafka.NewBatchConsumer(k.readerConfig(testenv.Name("g"), topic), bh, idemkafka.ConsumerOptions{
		DeadLetterTopic: k.dlq(t, topic),
		Telemetry: consumer.Telemetry{
			TracerProvider: spans,
			MeterProvider:  mp,
			Logger:         testLogger(t),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	run(t, c)
	eventually(t, 30*time.Second, "3 verdicts", func() bool { return mp.Sum(telemetry.MetricMessages) >= n })
	if got := mp.Sum(telemetry.MetricMessages, telemetry.AttrResult.String("ack"), telemetry.AttrSystem.String("kafka")); got != n {
		t.Errorf("acks = %v, want %d", got, n)
	}
	linked := map[trace.SpanID]bool{}
	var batchSpans int
	for _, s := range spans.Named("process " + topic) {
		if len(s.Links()) > 0 {
			batchSpans++
			if s.Parent().IsValid() {
				t.Errorf("a batch span has a parent: %v", s.Parent())
			}
			for _, l := range s.Links() {
				linked[l.SpanContext.SpanID()] = true
			}
			continue
		}
		// A record handled alone continues its trace.
		found := false
		for _, p := range producers {
			if s.Parent().SpanID() == p.SpanID() {
				found, linked[p.SpanID()] = true, true
			}
		}
		if !found {
			t.Errorf("a single-record span's parent %v is no producer's", s.Parent())
		}
	}
	for _, p := range producers {
		if !linked[p.SpanID()] {
			t.Errorf("producer span %v neither linked nor parent", p.SpanID())
		}
	}
	t.Logf("%d batch handler calls, %d batch spans", calls.Load(), batchSpans)
}

// Hostile trace headers (huge, malformed) never reach the propagator's
// parser and start new traces; a repeated header reads as its last value.
func TestConsumerHostileTraceHeaders(t *testing.T) {
	k := newKafka(t)
	topic := k.topic(t, "hostile", 1)
	spans := telemetrytest.NewSpans(t)
	good, goodHeaders := outboxHeaders(t, spans)
	other, otherHeaders := outboxHeaders(t, spans)
	huge := "00-" + strings.Repeat("a", 256<<10)
	withTP := func(id string, tps ...string) kafkago.Message {
		m := rec(0, "k", id, "v")
		for _, tp := range tps {
			m.Headers = append(m.Headers, kafkago.Header{Key: outbox.HeaderTraceParent, Value: []byte(tp)})
		}
		return m
	}
	k.produce(t, topic,
		withTP("huge", huge),
		withTP("garbage", "00-zz-yy-01"),
		withTP("repeated", otherHeaders[outbox.HeaderTraceParent], goodHeaders[outbox.HeaderTraceParent]),
	)
	var acked atomic.Int64
	c, err := idemkafka.NewConsumer(k.readerConfig(testenv.Name("g"), topic),
		consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }),
		idemkafka.ConsumerOptions{
			DeadLetterTopic: k.dlq(t, topic),
			Telemetry: consumer.Telemetry{
				TracerProvider: spans,
				Logger:         testLogger(t),
				OnOutcome: func(_ context.Context, rep consumer.Report) {
					r := rep.Result
					if r.Action == consumer.ActionAck {
						acked.Add(1)
					}
				},
			},
		})
	if err != nil {
		t.Fatal(err)
	}
	run(t, c)
	got := spans.Wait(t, "process "+topic, 3)
	if acked.Load() != 3 {
		t.Errorf("acked %d records, want 3", acked.Load())
	}
	var roots int
	for _, s := range got {
		off, _ := spanAttr(s, "messaging.kafka.offset")
		switch off.AsInt64() {
		case 0, 1:
			if s.Parent().IsValid() {
				t.Errorf("record %d: parent %v, want a new root", off.AsInt64(), s.Parent())
			}
			roots++
		case 2:
			if s.Parent().SpanID() != good.SpanContext().SpanID() {
				t.Errorf("repeated traceparent: parent %v, want the last header's %v (not %v)",
					s.Parent().SpanID(), good.SpanContext().SpanID(), other.SpanContext().SpanID())
			}
		}
	}
	if roots != 2 {
		t.Errorf("%d root spans, want 2", roots)
	}
}
