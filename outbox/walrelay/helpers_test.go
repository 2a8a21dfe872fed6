package walrelay_test

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
	"github.com/idemkit/idem/internal/testkit/outboxtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

// traceCtx is a context carrying a W3C traceparent received from
// elsewhere, as an application extracts it from an incoming request.
func traceCtx(traceparent string) context.Context {
	return propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier{outbox.HeaderTraceParent: traceparent})
}

// logicalPool returns a pool on the throwaway logical-replication cluster,
// closed when the test ends.
func logicalPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	url := logicalURL(t)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 6
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// sources runs f once per source, as subtests.
func sources(t *testing.T, f func(t *testing.T, src walrelay.Source)) {
	for _, src := range []walrelay.Source{walrelay.SourceTable, walrelay.SourceMessages} {
		t.Run(src.String(), func(t *testing.T) { f(t, src) })
	}
}

// newWAL creates an outbox in a fresh schema and migrates it (publication,
// slot, dead table). The slot and the publication, which outlive the
// schema, are dropped when the test ends (after its relays stopped).
func newWAL(t testing.TB, pool *pgxpool.Pool, opts walrelay.Options) *walrelay.Outbox {
	t.Helper()
	if opts.Schema == "" {
		opts.Schema = testenv.Schema(t, pool)
	}
	if opts.Logger == nil {
		opts.Logger = quiet()
	}
	ob, err := walrelay.New(pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	// Cleanups run last registered first: the slot is dropped, then the
	// publication.
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := pool.Exec(ctx, "DROP PUBLICATION IF EXISTS "+pgx.Identifier{ob.Options().Publication}.Sanitize()); err != nil {
			t.Errorf("drop publication: %v", err)
		}
	})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		// The server may take a moment to end a killed relay's stream.
		var dropErr error
		testenv.Eventually(t, 30*time.Second, "the slot dropped (no relay streaming it)", func() bool {
			err := ob.DropSlot(ctx)
			if errors.Is(err, walrelay.ErrSlotActive) && ctx.Err() == nil {
				return false
			}
			if err != nil && !errors.Is(err, walrelay.ErrNoSlot) {
				dropErr = err
			}
			return true
		})
		if dropErr != nil {
			t.Errorf("DropSlot: %v", dropErr)
		}
	})
	return ob
}

// enqueue commits msgs in one transaction and returns their ids.
func enqueue(t testing.TB, pool *pgxpool.Pool, ob *walrelay.Outbox, msgs ...outbox.Message) []string {
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
func fastRelay(o walrelay.RelayOptions) walrelay.RelayOptions {
	if o.Backoff == (consumer.Backoff{}) {
		o.Backoff = consumer.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}
	}
	if o.ReconnectBackoff == (consumer.Backoff{}) {
		o.ReconnectBackoff = consumer.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond}
	}
	if o.TakeoverInterval == 0 {
		o.TakeoverInterval = 50 * time.Millisecond
	}
	if o.StatusInterval == 0 {
		o.StatusInterval = 50 * time.Millisecond
	}
	if o.Logger == nil {
		o.Logger = quiet()
	}
	return o
}

func newRelay(t testing.TB, ob *walrelay.Outbox, pub outbox.Publisher, o walrelay.RelayOptions) *walrelay.Relay {
	t.Helper()
	r, err := walrelay.NewRelay(ob, pub, fastRelay(o))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// memPublisher records what it confirms. fail, when set, fails single
// messages; down, when set, fails whole batches. Every call wakes the
// waiters of wait.
type memPublisher struct {
	mu      sync.Mutex
	calls   int
	got     []outbox.Message // confirmed, in order
	tries   map[string]int   // publish attempts per id
	fail    func(m *outbox.Message) error
	down    func() error
	changed chan struct{}
}

func newMemPublisher() *memPublisher {
	return &memPublisher{tries: map[string]int{}, changed: make(chan struct{})}
}

func (p *memPublisher) Publish(_ context.Context, msgs []*outbox.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	defer func() {
		close(p.changed)
		p.changed = make(chan struct{})
	}()
	p.calls++
	if p.down != nil {
		if err := p.down(); err != nil {
			return err
		}
	}
	var pe outbox.PublishError
	for i, m := range msgs {
		p.tries[m.ID]++
		if p.fail != nil {
			if err := p.fail(m); err != nil {
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

func (p *memPublisher) setFail(f func(m *outbox.Message) error) {
	p.mu.Lock()
	p.fail = f
	p.mu.Unlock()
}

func (p *memPublisher) setDown(f func() error) {
	p.mu.Lock()
	p.down = f
	p.mu.Unlock()
}

func (p *memPublisher) published() []outbox.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]outbox.Message(nil), p.got...)
}

func (p *memPublisher) publishedIDs() map[string]int {
	out := map[string]int{}
	for _, m := range p.published() {
		out[m.ID]++
	}
	return out
}

// wait blocks until cond holds, re-checking it after every Publish call;
// the timeout only keeps a broken test from hanging.
func (p *memPublisher) wait(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(60 * time.Second)
	defer deadline.Stop()
	for {
		p.mu.Lock()
		ch := p.changed
		p.mu.Unlock()
		if cond() {
			return
		}
		select {
		case <-ch:
		case <-deadline.C:
			t.Fatalf("gave up after 60s waiting for %s", what)
		}
	}
}

// eventually polls cond until it holds, for states no hook reports (rows
// the relay writes, gauges); the timeout only keeps a broken test from
// hanging.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	testenv.Eventually(t, 60*time.Second, what, cond)
}

// waitIDs waits until every id was published at least once.
func (p *memPublisher) waitIDs(t testing.TB, ids []string) {
	t.Helper()
	p.wait(t, fmt.Sprintf("%d messages published", len(ids)), func() bool {
		got := p.publishedIDs()
		for _, id := range ids {
			if got[id] == 0 {
				return false
			}
		}
		return true
	})
}

var errBoom = errors.New("boom")

// confirmedPast waits until the slot's confirmed position reaches lsn.
func confirmedPast(t testing.TB, pool *pgxpool.Pool, ob *walrelay.Outbox, lsn string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for {
		var ok bool
		err := pool.QueryRow(ctx, "SELECT confirmed_flush_lsn >= $2::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
			ob.Options().Slot, lsn).Scan(&ok)
		if err != nil {
			t.Fatalf("slot position: %v", err)
		}
		if ok {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the slot's confirmed position did not reach %s", lsn)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// walEnd is the server's current WAL position.
func walEnd(t testing.TB, pool *pgxpool.Pool) string {
	t.Helper()
	var lsn string
	if err := pool.QueryRow(context.Background(), "SELECT pg_current_wal_insert_lsn()::text").Scan(&lsn); err != nil {
		t.Fatal(err)
	}
	return lsn
}

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
