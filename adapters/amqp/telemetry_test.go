package idemamqp

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

const telValidTP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

var telW3C = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// telOutboxHeaders starts a span, as the request that calls outbox.Enqueue
// would, and returns it with the headers the outbox stores for a message
// enqueued under it: the W3C traceparent in outbox.HeaderTraceParent.
func telOutboxHeaders(t *testing.T, tp trace.TracerProvider) (trace.Span, map[string]string) {
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

func telSpanAttr(s sdktrace.ReadOnlySpan, key attribute.Key) attribute.Value {
	for _, kv := range s.Attributes() {
		if kv.Key == key {
			return kv.Value
		}
	}
	return attribute.Value{}
}

// A trace started before the outbox stored the message is the parent of the
// consumer's span after a trip through the Publisher the relay uses and
// RabbitMQ, on the first delivery and on the retried copy; the Dedup claim
// runs under the consumer's span.
func TestConsumerContinuesOutboxTrace(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	delays := []time.Duration{10 * time.Millisecond}
	queue := consQueue(t, url, delays)
	spans := telemetrytest.NewSpans(t)
	producer, headers := telOutboxHeaders(t, spans)

	store, err := memstore.New(memstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = store.Close() })
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "test/trace", Telemetry: consumer.Telemetry{TracerProvider: spans}})
	if err != nil {
		t.Fatal(err)
	}
	var handlerTraces sync.Map
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		handlerTraces.Store(msg.Attempt, trace.SpanContextFromContext(ctx).TraceID())
		if msg.Attempt == 1 {
			return errors.New("not yet")
		}
		return nil
	}), dd)
	c, err := NewConsumer(url, queue, h, consOpts(ConsumerOptions{Backoff: consumer.Backoff{Initial: delays[0], Max: delays[0]}, Telemetry: consumer.Telemetry{TracerProvider: spans}}))
	if err != nil {
		t.Fatal(err)
	}
	consStart(t, c)

	pub, err := NewPublisher(url, PublisherOptions{Logger: consQuiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	if err := pub.Publish(t.Context(), []*outbox.Message{{ID: "order-7", Key: []byte(queue), Payload: []byte("p"), Headers: headers}}); err != nil {
		t.Fatal(err)
	}

	got := spans.Wait(t, "process "+queue, 2)
	pc := producer.SpanContext()
	results := map[string]int{}
	for _, cs := range got {
		if cs.Parent().TraceID() != pc.TraceID() || cs.Parent().SpanID() != pc.SpanID() || !cs.Parent().IsRemote() {
			t.Errorf("consumer span's parent = %v/%v (remote %v), want the producer's %v/%v",
				cs.Parent().TraceID(), cs.Parent().SpanID(), cs.Parent().IsRemote(), pc.TraceID(), pc.SpanID())
		}
		if cs.SpanKind() != trace.SpanKindConsumer {
			t.Errorf("span kind = %v, want consumer", cs.SpanKind())
		}
		if v := telSpanAttr(cs, telemetry.AttrSystem).AsString(); v != "rabbitmq" {
			t.Errorf("messaging.system = %q", v)
		}
		if v := telSpanAttr(cs, telemetry.AttrDestination).AsString(); v != queue {
			t.Errorf("messaging.destination.name = %q, want %q", v, queue)
		}
		results[telSpanAttr(cs, telemetry.AttrResult).AsString()]++
	}
	if results["retry"] != 1 || results["ack"] != 1 {
		t.Errorf("span results %v, want one retry and one ack", results)
	}
	consumerSpans := map[trace.SpanID]bool{}
	for _, cs := range got {
		consumerSpans[cs.SpanContext().SpanID()] = true
	}
	claims := spans.Wait(t, "idem.claim", 2)
	for _, cl := range claims {
		if !consumerSpans[cl.Parent().SpanID()] || cl.SpanContext().TraceID() != pc.TraceID() {
			t.Errorf("idem.claim's parent = %v, not a consumer span", cl.Parent().SpanID())
		}
	}
	for _, attempt := range []int{1, 2} {
		if v, _ := handlerTraces.Load(attempt); v != pc.TraceID() {
			t.Errorf("attempt %d: the handler's trace = %v, want %v", attempt, v, pc.TraceID())
		}
	}
}

// Each verdict is counted with the system, queue, result and dead-letter
// reason, and nothing holds a message id: no metric attribute, no log line.
func TestConsumerMetricsByVerdict(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	delays := []time.Duration{10 * time.Millisecond}
	queue := consQueue(t, url, delays)
	mp := telemetrytest.NewMetrics(t)
	h := consumer.Chain(consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error {
		switch m.ID {
		case "secret-flaky":
			if m.Attempt == 1 {
				return errors.New("not yet")
			}
		case "secret-poison":
			return consumer.Permanent(errors.New("poison"))
		case "secret-always":
			return errors.New("downstream unavailable")
		}
		return nil
	}), consMemDedup(t, "test/verdicts"))
	var logs telemetrytest.LogBuffer
	opts := consOpts(ConsumerOptions{Backoff: consumer.Backoff{Initial: delays[0], Max: delays[0]}, MaxAttempts: 2, Telemetry: consumer.Telemetry{MeterProvider: mp}})
	opts.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	c, err := NewConsumer(url, queue, h, opts)
	if err != nil {
		t.Fatal(err)
	}
	consStart(t, c)
	consPublish(t, url, queue,
		amqp091.Publishing{MessageId: "secret-ok", Body: []byte("a")},
		amqp091.Publishing{MessageId: "secret-flaky", Body: []byte("b")},
		amqp091.Publishing{MessageId: "secret-poison", Body: []byte("c")},
		amqp091.Publishing{MessageId: "secret-always", Body: []byte("d")},
		amqp091.Publishing{Body: []byte("no id")},
	)
	testenv.Eventually(t, 30*time.Second, "7 verdicts", func() bool { return mp.Sum(telemetry.MetricMessages) >= 7 })

	mp.CheckVerdicts("rabbitmq", queue, 7,
		telemetrytest.Verdict{Result: "ack", Want: 2},
		telemetrytest.Verdict{Result: "retry", Want: 2},
		telemetrytest.Verdict{Result: "dead_letter", Reason: string(consumer.OutcomePermanent), Want: 1},
		telemetrytest.Verdict{Result: "dead_letter", Reason: string(consumer.OutcomeRetriesExhausted), Want: 1},
		telemetrytest.Verdict{Result: "dead_letter", Reason: string(consumer.OutcomeInvalidKey), Want: 1})
	mp.NoValueContains("secret-")
	testenv.Eventually(t, 10*time.Second, "the dead-letter log lines", func() bool {
		return strings.Count(logs.String(), "message dead-lettered") == 3
	})
	if strings.Contains(logs.String(), "secret-") {
		t.Errorf("a log line holds a raw id:\n%s", logs.String())
	}
	if !strings.Contains(logs.String(), "message_id_hash=") {
		t.Errorf("no message_id_hash in the logs:\n%s", logs.String())
	}
}

// Trace headers of any type, or too long, never panic the consumer and
// start new traces; a traceparent sent as bytes is read.
func TestConsumerHostileTraceHeaders(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	queue := consQueue(t, url, consTestDelays)
	spans := telemetrytest.NewSpans(t)
	var acked atomic.Int64
	opts := consOpts(ConsumerOptions{
		Telemetry: consumer.Telemetry{
			TracerProvider: spans,
			OnOutcome: func(_ context.Context, r consumer.Report) {
				if r.Result.Action == consumer.ActionAck {
					acked.Add(1)
				}
			},
		},
	})
	c, err := NewConsumer(url, queue, consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }), opts)
	if err != nil {
		t.Fatal(err)
	}
	consStart(t, c)
	hostile := []any{
		int32(7),
		int64(-1),
		true,
		3.5,
		amqp091.Decimal{Scale: 2, Value: 12345},
		time.Unix(1, 0),
		amqp091.Table{"traceparent": telValidTP},
		[]any{telValidTP, int32(1)},
		nil,
		"00-" + strings.Repeat("f", 64<<10), // the broker's frame size bounds a header
		"garbage",
	}
	var msgs []amqp091.Publishing
	for i, v := range hostile {
		h := amqp091.Table{outbox.HeaderTraceParent: v}
		if s, _ := v.(string); len(s) < 1024 { // two long ones would pass the frame size
			h["baggage"] = v
		}
		msgs = append(msgs, amqp091.Publishing{MessageId: "h" + string(rune('a'+i)), Body: []byte("x"), Headers: h})
	}
	msgs = append(msgs, amqp091.Publishing{MessageId: "bytes", Body: []byte("x"),
		Headers: amqp091.Table{outbox.HeaderTraceParent: []byte(telValidTP)}})
	consPublish(t, url, queue, msgs...)

	got := spans.Wait(t, "process "+queue, len(msgs))
	var roots, parented int
	for _, s := range got {
		switch {
		case !s.Parent().IsValid():
			roots++
		case s.Parent().TraceID().String() == "4bf92f3577b34da6a3ce929d0e0e4736":
			parented++
		default:
			t.Errorf("unexpected parent %v", s.Parent())
		}
	}
	if roots != len(hostile) || parented != 1 {
		t.Errorf("%d roots and %d spans with the sent parent, want %d and 1", roots, parented, len(hostile))
	}
	testenv.Eventually(t, 10*time.Second, "every delivery acked", func() bool { return acked.Load() == int64(len(msgs)) })
}

// TableCarrier reads strings and bytes of at most MaxHeaderValue bytes and
// nothing else; a 1 MB value or a value of any other type is absent.
func TestTableCarrier(t *testing.T) {
	t.Parallel()
	huge := telValidTP + strings.Repeat(" ", 1<<20)
	for name, v := range map[string]any{
		"int": 5, "int8": int8(5), "int32": int32(5), "int64": int64(5), "uint8": uint8(5), "float": 1.5,
		"bool": true, "decimal": amqp091.Decimal{Scale: 1, Value: 5}, "time": time.Now(),
		"table": amqp091.Table{"traceparent": telValidTP}, "map": map[string]any{"a": telValidTP},
		"array": []any{telValidTP}, "strings": []string{telValidTP}, "nil": nil, "1MB string": huge,
		"1MB bytes": []byte(huge), "pointer": &huge, "struct": struct{ S string }{telValidTP},
	} {
		tab := amqp091.Table{outbox.HeaderTraceParent: v, "baggage": v, "tracestate": v}
		c := (*TableCarrier)(&tab)
		if got := c.Get(outbox.HeaderTraceParent); got != "" {
			t.Errorf("%s: Get = %.40q, want absent", name, got)
		}
		ctx := telW3C.Extract(context.Background(), c)
		if trace.SpanContextFromContext(ctx).IsValid() {
			t.Errorf("%s: a span context was extracted", name)
		}
		if len(c.Keys()) != 3 {
			t.Errorf("%s: Keys = %v", name, c.Keys())
		}
	}
	for name, v := range map[string]any{"string": telValidTP, "bytes": []byte(telValidTP)} {
		tab := amqp091.Table{outbox.HeaderTraceParent: v}
		c := (*TableCarrier)(&tab)
		if got := c.Get(outbox.HeaderTraceParent); got != telValidTP {
			t.Errorf("%s: Get = %q", name, got)
		}
		if sc := trace.SpanContextFromContext(telW3C.Extract(context.Background(), c)); sc.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" {
			t.Errorf("%s: extracted %v", name, sc.TraceID())
		}
	}
	exact := amqp091.Table{"x": strings.Repeat("a", telemetry.MaxHeaderValue)}
	if got := (*TableCarrier)(&exact).Get("x"); len(got) != telemetry.MaxHeaderValue {
		t.Errorf("a value of exactly MaxHeaderValue bytes reads as %d bytes", len(got))
	}

	// A nil table: Get and Keys see nothing, Set makes the table.
	var tab amqp091.Table
	c := (*TableCarrier)(&tab)
	if c.Get("traceparent") != "" || len(c.Keys()) != 0 {
		t.Error("a nil table is not empty")
	}
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2}, TraceFlags: trace.FlagsSampled})
	telW3C.Inject(trace.ContextWithSpanContext(context.Background(), sc), c)
	if tab[outbox.HeaderTraceParent] != "00-01000000000000000000000000000000-0200000000000000-01" {
		t.Errorf("Inject into a nil table: %v", tab)
	}
}

// The span of a delivery without any headers is a root; the default
// propagator and the global providers need no setup.
func TestTableCarrierNoHeaders(t *testing.T) {
	t.Parallel()
	spans := telemetrytest.NewSpans(t)
	a := telemetry.NewAdapter(nil, spans, system)
	d := amqp091.Delivery{}
	ctx, end := a.StartConsumer(context.Background(), nil, (*TableCarrier)(&d.Headers), "q")
	if !trace.SpanFromContext(ctx).IsRecording() {
		t.Fatal("no recording span")
	}
	end("ack", nil)
	if s := spans.Named("process q"); len(s) != 1 || s[0].Parent().IsValid() {
		t.Fatalf("spans %v", s)
	}
}

// FuzzTableCarrier builds a header table from arbitrary input: Get returns a
// value only for short strings and bytes, and extracting never panics.
func FuzzTableCarrier(f *testing.F) {
	f.Add("traceparent", byte(0), []byte(telValidTP), "traceparent")
	f.Add("baggage", byte(1), []byte("a=b,c=%zz"), "baggage")
	f.Add("traceparent", byte(5), []byte{1, 2, 3}, "traceparent")
	f.Add("", byte(9), []byte(nil), "")
	f.Fuzz(func(t *testing.T, key string, kind byte, data []byte, get string) {
		var v any
		switch kind % 12 {
		case 0:
			v = string(data)
		case 1:
			v = data
		case 2:
			v = int32(len(data))
		case 3:
			v = nil
		case 4:
			v = amqp091.Table{key: string(data)}
		case 5:
			v = []any{string(data), data}
		case 6:
			v = amqp091.Decimal{Scale: uint8(len(data)), Value: int32(len(data))}
		case 7:
			v = len(data)%2 == 0
		case 8:
			v = float64(len(data))
		case 9:
			v = time.Unix(int64(len(data)), 0)
		case 10:
			v = strings.Repeat(string(data), 1+telemetry.MaxHeaderValue/max(len(data), 1))
		default:
			v = map[string]any{key: data}
		}
		tab := amqp091.Table{key: v, "other": data}
		c := (*TableCarrier)(&tab)
		got := c.Get(get)
		want := ""
		switch x := tab[get].(type) {
		case string:
			want = x
		case []byte:
			want = string(x)
		}
		if len(want) > telemetry.MaxHeaderValue {
			want = ""
		}
		if got != want {
			t.Fatalf("Get(%q) = %.40q, want %.40q", get, got, want)
		}
		_ = telW3C.Extract(context.Background(), c)
		_ = c.Keys()
	})
}
