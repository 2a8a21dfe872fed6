package pgoutbox_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/propagation"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/outboxtest"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// newOutbox creates an outbox in a fresh schema (dropped after the test) and
// migrates it.
func newOutbox(t testing.TB, pool *pgxpool.Pool, opts pgoutbox.Options) *pgoutbox.Outbox {
	t.Helper()
	if opts.Schema == "" {
		opts.Schema = testenv.Schema(t, pool)
	}
	if opts.Logger == nil {
		opts.Logger = quiet()
	}
	ob, err := pgoutbox.New(pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return ob
}

// enqueue commits msgs in one transaction and returns their ids.
func enqueue(t testing.TB, pool *pgxpool.Pool, ob *pgoutbox.Outbox, msgs ...outbox.Message) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var ids []string
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		ids, err = ob.Enqueue(ctx, tx, msgs...)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// fastRelay are relay options that make tests quick.
func fastRelay(o pgoutbox.RelayOptions) pgoutbox.RelayOptions {
	if o.PollInterval == 0 {
		o.PollInterval = 100 * time.Millisecond
	}
	if o.RebalanceInterval == 0 {
		o.RebalanceInterval = 100 * time.Millisecond
	}
	if o.Backoff == (consumer.Backoff{}) {
		o.Backoff = consumer.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond}
	}
	if o.ReconnectBackoff == (consumer.Backoff{}) {
		o.ReconnectBackoff = consumer.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond}
	}
	if o.Logger == nil {
		o.Logger = quiet()
	}
	return o
}

// memPublisher records what it publishes. fail, when set, fails single
// messages; down, when set, fails whole batches.
type memPublisher struct {
	mu    sync.Mutex
	calls int
	got   []outbox.Message // confirmed, in order
	fail  func(m *outbox.Message) error
	down  func() error
	delay time.Duration
}

func (p *memPublisher) Publish(ctx context.Context, msgs []*outbox.Message) error {
	p.mu.Lock()
	p.calls++
	fail, down, delay := p.fail, p.down, p.delay
	p.mu.Unlock()
	if delay > 0 {
		select {
		case <-time.After(delay):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if down != nil {
		if err := down(); err != nil {
			return err
		}
	}
	var pe outbox.PublishError
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, m := range msgs {
		if fail != nil {
			if err := fail(m); err != nil {
				if pe.Failed == nil {
					pe.Failed = map[int]error{}
				}
				pe.Failed[i] = err
				continue
			}
		}
		c := *m
		c.Headers = maps.Clone(m.Headers)
		p.got = append(p.got, c)
	}
	if pe.Failed != nil {
		return &pe
	}
	return nil
}

func (p *memPublisher) published() []outbox.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]outbox.Message(nil), p.got...)
}

func (p *memPublisher) callCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls
}

func (p *memPublisher) publishedIDs() map[string]int {
	out := map[string]int{}
	for _, m := range p.published() {
		out[m.ID]++
	}
	return out
}

// counts reads a relay's outbox counters (idem.outbox.published, .retried,
// .dead) from its MeterProvider.
func counts(mp *telemetrytest.Metrics) (published, retried, dead int) {
	return int(mp.Sum(telemetry.MetricOutboxPublished)), int(mp.Sum(telemetry.MetricOutboxRetried)), int(mp.Sum(telemetry.MetricOutboxDead))
}

// onIdle returns a channel that receives (without blocking the relay)
// each time a session of r starts waiting for a notification.
func onIdle(r *pgoutbox.Relay) <-chan struct{} {
	ch := make(chan struct{}, 1)
	pgoutbox.SetOnIdle(r, func() {
		select {
		case ch <- struct{}{}:
		default:
		}
	})
	return ch
}

// waitIdle waits until a session reports it went idle.
func waitIdle(t testing.TB, idle <-chan struct{}) {
	t.Helper()
	select {
	case <-idle:
	case <-time.After(20 * time.Second):
		t.Fatal("no session went idle within 20s")
	}
}

// idleWaits waits until sessions went idle n more times from now on: each
// wait ends at the poll or rebalance interval at the latest, so this spans
// several of the relay's wake-ups.
func idleWaits(t testing.TB, idle <-chan struct{}, n int) {
	t.Helper()
	select {
	case <-idle: // an idle reported before now
	default:
	}
	for range n {
		waitIdle(t, idle)
	}
}

// traceCtx is a context carrying a W3C trace context received from
// elsewhere, as an application extracts it from an incoming request.
func traceCtx(traceparent, tracestate string) context.Context {
	return propagation.TraceContext{}.Extract(context.Background(),
		propagation.MapCarrier{outbox.HeaderTraceParent: traceparent, outbox.HeaderTraceState: tracestate})
}

// rowState reads the state, attempts and seq of a message by id.
type rowInfo struct {
	seq      int64
	state    int
	attempts int
	lastErr  *string
}

func rowsByID(t testing.TB, pool *pgxpool.Pool, ob *pgoutbox.Outbox) map[string]rowInfo {
	t.Helper()
	rows, err := pool.Query(context.Background(), "SELECT id::text, seq, state, attempts, last_error FROM "+ob.Table())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]rowInfo{}
	var (
		id string
		ri rowInfo
	)
	if _, err := pgx.ForEachRow(rows, []any{&id, &ri.seq, &ri.state, &ri.attempts, &ri.lastErr}, func() error {
		out[id] = ri
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

func countState(t testing.TB, pool *pgxpool.Pool, ob *pgoutbox.Outbox, state int) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+ob.Table()+" WHERE state = $1", state).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

var errBoom = errors.New("boom")

func keyOf(i, keys int) string { return fmt.Sprintf("k%03d", i%keys) }

// The helpers every relay's tests share.
var (
	quiet = outboxtest.Quiet
	msg   = outboxtest.Msg
)

// running is a relay started by start, ended by stop (or the end of the test).
type running struct{ *outboxtest.Running }

func (rr *running) stop(t testing.TB) { t.Helper(); rr.Stop(t) }

func start(t testing.TB, r interface{ Run(context.Context) error }) *running {
	t.Helper()
	return &running{outboxtest.Start(t, r)}
}
