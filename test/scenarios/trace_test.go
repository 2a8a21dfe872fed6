package scenarios

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
	kafkago "github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/testkit/kafkatest"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// The whole trip of a traced order: a span is open when the order is written and
// outbox.Enqueue runs in its transaction; the pgoutbox relay publishes the
// row through the real publisher; the consumer on the other side continues
// the trace: its process span is the child of the enqueuing span, and the
// claim runs under it.
func TestTraceSurvivesOutboxRelayAndBroker(t *testing.T) {
	t.Parallel()
	t.Run("kafka", func(t *testing.T) {
		k := kafkatest.New(t)
		topic := k.Topic(t, "idemtrace", 1)
		dlq := topic + "_dlq"
		k.CreateTopic(t, dlq, 1)
		w := &kafkago.Writer{Addr: kafkago.TCP(k.Brokers...), Transport: k.Transport,
			RequiredAcks: kafkago.RequireAll, BatchTimeout: 10 * time.Millisecond}
		t.Cleanup(func() { _ = w.Close() })
		pub, err := idemkafka.NewPublisher(w, idemkafka.PublisherOptions{})
		if err != nil {
			t.Fatal(err)
		}
		traceTrip(t, topic, "", pub, func(h consumer.Handler, tp trace.TracerProvider) runner {
			c, err := idemkafka.NewConsumer(kafkago.ReaderConfig{Brokers: k.Brokers, GroupID: testenv.Name("g"), Topic: topic,
				Dialer: &kafkago.Dialer{Timeout: 10 * time.Second}, MaxWait: 50 * time.Millisecond},
				h, idemkafka.ConsumerOptions{DeadLetterTopic: dlq, Telemetry: consumer.Telemetry{TracerProvider: tp}})
			if err != nil {
				t.Fatal(err)
			}
			return runner{run: c.Run}
		})
	})
	t.Run("rabbitmq", func(t *testing.T) {
		testenv.RequireTCP(t, "RabbitMQ", "127.0.0.1:5672")
		queue := testenv.Name("idemtrace")
		pub, err := idemamqp.NewPublisher(testenv.AMQPURL(), idemamqp.PublisherOptions{SkipExchangeCheck: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = pub.Close() })
		// The default exchange routes on the queue name.
		t.Cleanup(func() {
			conn, err := amqp091.Dial(testenv.AMQPURL())
			if err != nil {
				return
			}
			defer func() { _ = conn.Close() }()
			ch, err := conn.Channel()
			if err != nil {
				return
			}
			for _, q := range []string{queue, queue + ".dlq", queue + ".retry.1000ms"} {
				_, _ = ch.QueueDelete(q, false, false, false)
			}
			_ = ch.ExchangeDelete(queue+".dlx", false, false)
		})
		traceTrip(t, "", queue, pub, func(h consumer.Handler, tp trace.TracerProvider) runner {
			c, err := idemamqp.NewConsumer(testenv.AMQPURL(), queue, h, idemamqp.ConsumerOptions{
				NotDurable: true, Backoff: consumer.Backoff{Initial: time.Second, Max: time.Second},
				Telemetry: consumer.Telemetry{
					TracerProvider: tp,
				}})
			if err != nil {
				t.Fatal(err)
			}
			return runner{run: c.Run, ready: c.Ready()}
		})
	})
}

type runner struct {
	run   func(context.Context) error
	ready <-chan struct{}
}

func traceTrip(t *testing.T, topic, key string, pub outbox.Publisher, mk func(consumer.Handler, trace.TracerProvider) runner) {
	spans := telemetrytest.NewSpans(t)
	pool := testenv.Pool(t, 6)
	schema := testenv.Schema(t, pool)
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(t.Context()); err != nil {
		t.Fatal(err)
	}

	store, err := memstore.New(memstore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = store.Close() })
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "billing/charge", Telemetry: consumer.Telemetry{TracerProvider: spans}})
	if err != nil {
		t.Fatal(err)
	}
	var (
		handled  atomic.Value
		reached  = make(chan struct{}) // closed once handled is set
		reachedO sync.Once
	)
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
		handled.Store(trace.SpanContextFromContext(ctx))
		reachedO.Do(func() { close(reached) })
		return nil
	}), dd)

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 2)
	t.Cleanup(func() {
		cancel()
		for range 2 {
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("consumer or relay: %v", err)
			}
		}
	})
	c := mk(h, spans)
	go func() { done <- c.run(ctx) }()
	if c.ready != nil {
		select {
		case <-c.ready:
		case <-time.After(30 * time.Second):
			t.Fatal("consumer not ready")
		}
	}
	relay, err := pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{PollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	go func() { done <- relay.Run(ctx) }()

	reqCtx, req := spans.Tracer("test").Start(t.Context(), "POST /orders")
	err = pgx.BeginFunc(reqCtx, pool, func(tx pgx.Tx) error {
		_, err := ob.Enqueue(reqCtx, tx, outbox.Message{Topic: topic, Key: []byte(key), Payload: []byte(`{"order":7}`)})
		return err
	})
	req.End()
	if err != nil {
		t.Fatal(err)
	}
	want := req.SpanContext()

	select {
	case <-reached:
	case <-time.After(60 * time.Second):
		t.Fatal("the message never reached the handler")
	}
	var process trace.SpanContext
	testenv.Eventually(t, 60*time.Second, "a consumer span to end", func() bool {
		for _, s := range spans.Ended() {
			if s.SpanKind() == trace.SpanKindConsumer {
				if s.Parent().SpanID() != want.SpanID() || s.Parent().TraceID() != want.TraceID() {
					t.Fatalf("consumer span %q has parent %v, want the enqueuing span %v", s.Name(), s.Parent(), want)
				}
				process = s.SpanContext()
			}
		}
		return process.IsValid()
	})
	claims := spans.Named("idem.claim")
	if len(claims) != 1 || claims[0].Parent().SpanID() != process.SpanID() {
		t.Fatalf("idem.claim spans %d, parent %v; want one under the consumer span %v", len(claims), claims, process.SpanID())
	}
	if got := handled.Load().(trace.SpanContext); got.TraceID() != want.TraceID() {
		t.Fatalf("the handler ran in trace %v, want %v", got.TraceID(), want.TraceID())
	}
}
