package idemwatermill_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// maxConns bounds every test pool.
const maxConns = 8

var nopLogger = wm.NopLogger{}

// newGoChannel returns an in-process pub/sub whose Publish returns only once
// every subscriber acknowledged the message: when Publish returns, the
// message was processed, every nack redelivered, and every retry done. The
// tests wait on that instead of on the clock.
func newGoChannel(t testing.TB) *gochannel.GoChannel {
	t.Helper()
	ps := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, nopLogger)
	t.Cleanup(func() { _ = ps.Close() })
	return ps
}

func newRouter(t testing.TB) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: time.Minute}, nopLogger)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// startRouter runs r until the test ends. It returns once every handler
// subscribed.
func startRouter(t testing.TB, r *message.Router) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("router stopped at once: %v", err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("router close: %v", err)
		}
		if err := <-done; err != nil {
			t.Errorf("router run: %v", err)
		}
	})
}

// fastRetry is Watermill's Retry middleware with short waits.
func fastRetry(maxRetries int) middleware.Retry {
	return middleware.Retry{
		MaxRetries:      maxRetries,
		InitialInterval: time.Millisecond,
		MaxInterval:     20 * time.Millisecond,
		Multiplier:      2,
	}
}

// uuidKey is the Deduplicator key factory the tests give Watermill's stock
// middleware: the message UUID, the same id idem keys on.
func uuidKey(m *message.Message) (string, error) { return m.UUID, nil }

// oracle records effects where duplicates show: a PostgreSQL table without a
// unique constraint, or a map.
type oracle interface {
	// record applies msg's effect for handler: through the claim's
	// transaction when the handler runs under Transactional.
	record(msg *message.Message, handler string) error
	// counts returns the number of effects per "handler/id".
	counts(t testing.TB) map[string]int
}

type memOracle struct {
	mu sync.Mutex
	n  map[string]int
}

func newMemOracle() *memOracle { return &memOracle{n: map[string]int{}} }

func (o *memOracle) record(msg *message.Message, handler string) error {
	o.mu.Lock()
	o.n[handler+"/"+msg.UUID]++
	o.mu.Unlock()
	return nil
}

func (o *memOracle) counts(testing.TB) map[string]int {
	o.mu.Lock()
	defer o.mu.Unlock()
	out := make(map[string]int, len(o.n))
	for k, v := range o.n {
		out[k] = v
	}
	return out
}

type pgOracle struct {
	pool  *pgxpool.Pool
	table string
}

func newPGOracle(t testing.TB, pool *pgxpool.Pool, schema string) *pgOracle {
	t.Helper()
	o := &pgOracle{pool: pool, table: pgx.Identifier{schema, "effects"}.Sanitize()}
	if _, err := pool.Exec(context.Background(), "CREATE TABLE "+o.table+
		" (handler text NOT NULL, id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"); err != nil {
		t.Fatal(err)
	}
	return o
}

func (o *pgOracle) record(msg *message.Message, handler string) error {
	ctx := msg.Context()
	q := "INSERT INTO " + o.table + " (handler, id) VALUES ($1, $2)"
	if tx := idemwatermill.Tx[pgx.Tx](ctx); tx != nil {
		_, err := tx.Exec(ctx, q, handler, msg.UUID)
		return err
	}
	_, err := o.pool.Exec(ctx, q, handler, msg.UUID)
	return err
}

func (o *pgOracle) counts(t testing.TB) map[string]int {
	t.Helper()
	rows, err := o.pool.Query(context.Background(), "SELECT handler || '/' || id, count(*) FROM "+o.table+" GROUP BY 1")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	var k string
	var n int
	if _, err := pgx.ForEachRow(rows, []any{&k, &n}, func() error { out[k] = n; return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

// duplicates returns the keys of c with more than one effect (the oracle's
// GROUP BY ... HAVING count(*) > 1).
func duplicates(c map[string]int) []string {
	var d []string
	for k, n := range c {
		if n > 1 {
			d = append(d, fmt.Sprintf("%s×%d", k, n))
		}
	}
	return d
}

// fixture is one store under test: a middleware factory on one shared store
// (every call is another instance of the service on the same store) and an
// oracle.
type fixture struct {
	middleware func(t testing.TB, opts idemwatermill.Options) message.HandlerMiddleware
	oracle     oracle
	// pgStore is the pgtable store, for the kinds that have one.
	pgStore *pgtable.Store
	pool    *pgxpool.Pool
	schema  string
}

type kind struct {
	name  string
	setup func(t testing.TB) *fixture
}

// must returns v, and panics on a setup error (the test fails with it).
func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func memKind() kind {
	return kind{name: "memstore", setup: func(t testing.TB) *fixture {
		s := must(memstore.New(memstore.Options{SweepInterval: -1}))
		t.Cleanup(func() { _ = s.Close() })
		return &fixture{
			oracle: newMemOracle(),
			middleware: func(t testing.TB, opts idemwatermill.Options) message.HandlerMiddleware {
				return must(idemwatermill.Dedup(s, opts))
			},
		}
	}}
}

// pgEnv returns a pool (at most maxConns connections) and a fresh schema.
func pgEnv(t testing.TB) (*pgxpool.Pool, string) {
	t.Helper()
	pool := testenv.Pool(t, maxConns)
	return pool, testenv.Schema(t, pool)
}

func newPGStore(t testing.TB, pool *pgxpool.Pool, schema string, opts pgtable.Options) *pgtable.Store {
	t.Helper()
	opts.Schema = schema
	s := must(pgtable.New(pool, opts))
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s
}

func redisKind() kind {
	return kind{name: "redisnx", setup: func(t testing.TB) *fixture {
		client := testenv.Redis(t)
		pool, schema := pgEnv(t)
		s := must(redisnx.New(client, redisnx.Options{Prefix: testenv.Name("idemwm")}))
		return &fixture{
			oracle: newPGOracle(t, pool, schema),
			pool:   pool, schema: schema,
			middleware: func(t testing.TB, opts idemwatermill.Options) message.HandlerMiddleware {
				return must(idemwatermill.Dedup(s, opts))
			},
		}
	}}
}

func pgLeaseKind() kind {
	return kind{name: "pgtable_lease", setup: func(t testing.TB) *fixture {
		pool, schema := pgEnv(t)
		s := newPGStore(t, pool, schema, pgtable.Options{})
		return &fixture{
			oracle: newPGOracle(t, pool, schema),
			pool:   pool, schema: schema, pgStore: s,
			middleware: func(t testing.TB, opts idemwatermill.Options) message.HandlerMiddleware {
				return must(idemwatermill.Dedup(s.Lease(), opts))
			},
		}
	}}
}

func pgTxKind() kind {
	return kind{name: "pgtable_tx", setup: func(t testing.TB) *fixture {
		pool, schema := pgEnv(t)
		s := newPGStore(t, pool, schema, pgtable.Options{})
		return &fixture{
			oracle: newPGOracle(t, pool, schema),
			pool:   pool, schema: schema, pgStore: s,
			middleware: func(t testing.TB, opts idemwatermill.Options) message.HandlerMiddleware {
				return must(idemwatermill.Transactional(s, opts))
			},
		}
	}}
}

// allKinds are every store the middleware runs on.
func allKinds() []kind { return []kind{memKind(), redisKind(), pgLeaseKind(), pgTxKind()} }

// sharedKinds are the stores shared between processes (real PostgreSQL and
// Redis).
func sharedKinds() []kind { return []kind{redisKind(), pgLeaseKind(), pgTxKind()} }

// recordingPublisher is a message.Publisher that keeps what it is given.
type recordingPublisher struct {
	mu     sync.Mutex
	topics []string
	msgs   []*message.Message
	err    func(topic string) error
}

func (p *recordingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.err != nil {
		if err := p.err(topic); err != nil {
			return err
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		p.topics = append(p.topics, topic)
		p.msgs = append(p.msgs, m)
	}
	return nil
}

func (p *recordingPublisher) Close() error { return nil }

func (p *recordingPublisher) published() ([]string, []*message.Message) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.topics...), append([]*message.Message(nil), p.msgs...)
}

// leaseStore wraps a dedup.LeaseStore with hooks, for fault injection.
type leaseStore struct {
	dedup.LeaseStore
	claim    func(ctx context.Context, k dedup.Key) (*dedup.Lease, error)
	extend   func(ctx context.Context, l *dedup.Lease) error
	complete func(ctx context.Context, l *dedup.Lease) error
}

func (s *leaseStore) Claim(ctx context.Context, k dedup.Key) (*dedup.Lease, error) {
	if s.claim != nil {
		return s.claim(ctx, k)
	}
	return s.LeaseStore.Claim(ctx, k)
}

func (s *leaseStore) Extend(ctx context.Context, l *dedup.Lease) error {
	if s.extend != nil {
		if err := s.extend(ctx, l); err != nil {
			return err
		}
	}
	return s.LeaseStore.Extend(ctx, l)
}

func (s *leaseStore) Complete(ctx context.Context, l *dedup.Lease, result []byte) error {
	if s.complete != nil {
		if err := s.complete(ctx, l); err != nil {
			return err
		}
	}
	return s.LeaseStore.Complete(ctx, l, result)
}

var errGateway = errors.New("payment gateway timed out")

func newMemstore(t testing.TB) *memstore.Store {
	t.Helper()
	s := must(memstore.New(memstore.Options{SweepInterval: -1}))
	t.Cleanup(func() { _ = s.Close() })
	return s
}
