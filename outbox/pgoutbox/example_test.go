package pgoutbox_test

import (
	"cmp"
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// postgresURL is the database the examples run on.
var postgresURL = cmp.Or(os.Getenv("IDEM_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")

// printPublisher stands in for a broker adapter (adapters/amqp,
// adapters/kafka): it prints what it is given and confirms it.
type printPublisher struct {
	mu   sync.Mutex
	seen int
	done chan struct{}
}

func (p *printPublisher) Publish(_ context.Context, msgs []*outbox.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		fmt.Printf("published to %s, key %s: %s (traceparent %s)\n", m.Topic, m.Key, m.Payload, m.Headers[outbox.HeaderTraceParent])
		p.seen++
	}
	if p.seen == 2 {
		close(p.done)
	}
	return nil
}

// An order is written with its outgoing events in one transaction. The
// relay is woken by the commit and publishes them, in order for the key; the
// events of a rolled-back transaction are never published.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, postgresURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	// A fresh schema per run, dropped at the end.
	schema := "idem_example_" + strings.ToLower(rand.Text())
	defer func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	}()
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := ob.Migrate(ctx); err != nil { // creates the schema and the outbox table
		fmt.Println(err)
		return
	}
	orders := pgx.Identifier{schema, "orders"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+orders+" (id text PRIMARY KEY, total int NOT NULL)"); err != nil {
		fmt.Println(err)
		return
	}

	pub := &printPublisher{done: make(chan struct{})}
	relay, err := pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{})
	if err != nil {
		fmt.Println(err)
		return
	}
	rctx, stop := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(rctx) }()
	shutdown := sync.OnceValue(func() error { stop(); return <-relayDone })
	defer func() { _ = shutdown() }()

	// The request's trace context travels with the events: here the
	// traceparent header of an incoming request, put in the context by
	// OpenTelemetry's W3C propagator (with a tracing SDK, the span the
	// request handler runs in is enough).
	reqCtx := propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier{
		outbox.HeaderTraceParent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
	})
	placeOrder := func(id string, total int, commit bool) error {
		tx, err := pool.Begin(reqCtx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(reqCtx) }()
		if _, err := tx.Exec(reqCtx, "INSERT INTO "+orders+" VALUES ($1, $2)", id, total); err != nil {
			return err
		}
		if _, err := ob.Enqueue(reqCtx, tx,
			outbox.Message{Topic: "orders", Key: []byte(id), Payload: []byte("placed " + id)},
			outbox.Message{Topic: "orders", Key: []byte(id), Payload: []byte(fmt.Sprint("charged ", total))},
		); err != nil {
			return err
		}
		if !commit {
			return nil // rolled back by the deferred Rollback: nothing is published
		}
		return tx.Commit(reqCtx)
	}
	if err := placeOrder("order-1", 42, false); err != nil {
		fmt.Println(err)
		return
	}
	if err := placeOrder("order-2", 17, true); err != nil {
		fmt.Println(err)
		return
	}

	<-pub.done
	if err := shutdown(); err != nil { // lets the batch in flight finish
		fmt.Println(err)
	}
	pending, _, err := ob.Backlog(ctx)
	fmt.Println("pending:", pending, err)
	// Output:
	// published to orders, key order-2: placed order-2 (traceparent 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01)
	// published to orders, key order-2: charged 17 (traceparent 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01)
	// pending: 0 <nil>
}

// SQL prints the migrations for a migration tool.
func ExampleOutbox_SQL() {
	ob, err := pgoutbox.New(nil, pgoutbox.Options{Schema: "billing", Table: "outbox"}) // no pool needed to print
	if err != nil {
		fmt.Println(err)
		return
	}
	script, err := ob.SQL()
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(strings.SplitN(script, "\n", 2)[0])
	fmt.Println(strings.Contains(script, `CREATE TABLE IF NOT EXISTS "billing"."outbox"`))
	fmt.Println(ob.Channel())
	// Output:
	// CREATE SCHEMA IF NOT EXISTS "billing";
	// true
	// idem_outbox.billing.outbox
}

// confirmOne is a Publisher that confirms everything and signals the first
// message.
type confirmOne struct {
	once sync.Once
	got  chan *outbox.Message
}

func (p *confirmOne) Publish(_ context.Context, msgs []*outbox.Message) error {
	p.once.Do(func() { p.got <- msgs[0] })
	return nil
}

// The relay reports its metrics to an OpenTelemetry MeterProvider (here a
// manual reader; in production the Prometheus exporter or OTLP) and sends
// the trace of the span active at Enqueue as the message's traceparent.
func ExampleRelayOptions_openTelemetry() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, postgresURL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	schema := "idem_example_" + strings.ToLower(rand.Text())
	defer func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	}()
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := ob.Migrate(ctx); err != nil {
		fmt.Println(err)
		return
	}

	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	tp := sdktrace.NewTracerProvider()
	defer func() { _ = tp.Shutdown(context.Background()) }()

	pub := &confirmOne{got: make(chan *outbox.Message, 1)}
	relay, err := pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{Telemetry: consumer.Telemetry{MeterProvider: mp, TracerProvider: tp}})
	if err != nil {
		fmt.Println(err)
		return
	}
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(rctx) }()

	reqCtx, span := tp.Tracer("checkout").Start(ctx, "place order")
	err = pgx.BeginFunc(reqCtx, pool, func(tx pgx.Tx) error {
		_, err := ob.Enqueue(reqCtx, tx, outbox.Message{Topic: "orders", Key: []byte("order-1"), Payload: []byte("placed")})
		return err
	})
	span.End()
	if err != nil {
		fmt.Println(err)
		stop()
		if err := <-relayDone; err != nil {
			fmt.Println(err)
		}
		return
	}
	m := <-pub.got
	// What a consumer continues:
	sc := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier(m.Headers)))
	fmt.Println("child of the enqueuing span:", sc.SpanID() == span.SpanContext().SpanID())

	stop()
	if err := <-relayDone; err != nil { // the batch is marked before Run returns
		fmt.Println(err)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		fmt.Println(err)
		return
	}
	for _, sm := range rm.ScopeMetrics {
		for _, md := range sm.Metrics {
			if sum, ok := md.Data.(metricdata.Sum[int64]); ok && md.Name == "idem.outbox.published" {
				for _, p := range sum.DataPoints {
					topic, _ := p.Attributes.Value("messaging.destination.name")
					fmt.Println(md.Name, topic.AsString(), p.Value)
				}
			}
		}
	}
	// Output:
	// child of the enqueuing span: true
	// idem.outbox.published orders 1
}
