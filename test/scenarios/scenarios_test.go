package scenarios_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"math/big"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/dedup/twolevel"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, testenv.LeakOptions()...) }

// payments is a payment service instance: what one server behind a load
// balancer runs. charge applies the payment at most once per id and returns
// its receipt; a caller that gets a receipt always gets the first one.
type payments interface {
	charge(ctx context.Context, id string, amount int64, gateway time.Duration) (string, error)
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// txPayments charges inside the transaction that holds the claim
// (pgtable, or twolevel in front of it).
type txPayments struct {
	store dedup.TxStore[pgx.Tx]
	o     *testenv.Charges
}

func (p *txPayments) charge(ctx context.Context, id string, amount int64, gateway time.Duration) (string, error) {
	key := dedup.NewKey("payments/charge", id, []byte(fmt.Sprint(amount)))
	for {
		res, err := p.store.Process(ctx, key, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			r := testenv.Receipt()
			if _, err := tx.Exec(ctx, p.o.Insert(), id, r, amount); err != nil {
				return nil, err
			}
			if err := sleepCtx(ctx, gateway); err != nil { // a slow gateway
				return nil, err
			}
			return []byte(r), nil
		})
		if stored, dup := dedup.StoredResult(err); dup {
			return string(stored), nil
		}
		if errors.Is(err, dedup.ErrInFlight) { // two-level: the cache saw it in flight
			if err := sleepCtx(ctx, 5*time.Millisecond); err != nil {
				return "", err
			}
			continue
		}
		return string(res), err
	}
}

// leasePayments charges an external gateway (the oracle insert stands for
// it) under a lease: redisnx or pgtable's lease mode.
type leasePayments struct {
	store dedup.LeaseStore
	o     *testenv.Charges
}

func (p *leasePayments) charge(ctx context.Context, id string, amount int64, gateway time.Duration) (string, error) {
	key := dedup.NewKey("payments/charge", id, []byte(fmt.Sprint(amount)))
	for {
		l, err := p.store.Claim(ctx, key)
		if stored, dup := dedup.StoredResult(err); dup {
			return string(stored), nil
		}
		if errors.Is(err, dedup.ErrInFlight) {
			if err := sleepCtx(ctx, 5*time.Millisecond); err != nil {
				return "", err
			}
			continue
		}
		if err != nil {
			return "", err
		}
		r := testenv.Receipt()
		if err := sleepCtx(ctx, gateway); err != nil {
			_ = p.store.Release(context.WithoutCancel(ctx), l)
			return "", err
		}
		if _, err := p.o.Pool.Exec(ctx, p.o.Insert(), id, r, amount); err != nil {
			_ = p.store.Release(context.WithoutCancel(ctx), l)
			return "", err
		}
		if err := p.store.Complete(ctx, l, []byte(r)); err != nil {
			return "", err
		}
		return r, nil
	}
}

// backend makes two service instances (each with its own pool and Redis
// client, as two servers behind a load balancer have) over the same stores.
type backend struct {
	name string
	make func(t *testing.T, schema, prefix string, o *testenv.Charges) (payments, payments)
	// own, when set, makes the instances and their oracle in a database
	// of the backend's own instead (the stores on database/sql).
	own func(t *testing.T) (payments, payments, oracle)
}

// oracle counts the charges of a scenario: testenv.Charges on PostgreSQL,
// sqlCharges on the databases of sqltable.
type oracle interface {
	Check(t testing.TB, want []string, seen map[string][]string)
}

func newPool(t *testing.T) *pgxpool.Pool { return testenv.Pool(t, 12) }

func newRedis(t *testing.T) *redis.Client { return testenv.Redis(t) }

func pgStore(t *testing.T, schema string) *pgtable.Store {
	s, err := pgtable.New(newPool(t), pgtable.Options{Schema: schema, Lease: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s
}

func redisStore(t *testing.T, prefix string) *redisnx.Store {
	s, err := redisnx.New(newRedis(t), redisnx.Options{Prefix: prefix, Lease: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

var backends = []backend{
	{name: "pgtable", make: func(t *testing.T, schema, _ string, o *testenv.Charges) (payments, payments) {
		return &txPayments{pgStore(t, schema), o}, &txPayments{pgStore(t, schema), o}
	}},
	{name: "pgtable_lease", make: func(t *testing.T, schema, _ string, o *testenv.Charges) (payments, payments) {
		return &leasePayments{pgStore(t, schema).Lease(), o}, &leasePayments{pgStore(t, schema).Lease(), o}
	}},
	{name: "redisnx", make: func(t *testing.T, _, prefix string, o *testenv.Charges) (payments, payments) {
		return &leasePayments{redisStore(t, prefix), o}, &leasePayments{redisStore(t, prefix), o}
	}},
	{name: "twolevel", make: func(t *testing.T, schema, prefix string, o *testenv.Charges) (payments, payments) {
		mk := func() payments {
			s, err := twolevel.New(redisStore(t, prefix), pgStore(t, schema), twolevel.Options{})
			if err != nil {
				t.Fatal(err)
			}
			return &txPayments{s, o}
		}
		return mk(), mk()
	}},
}

type env struct {
	a, b payments
	o    oracle
}

func forEachBackend(t *testing.T, fn func(t *testing.T, e env)) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			if b.own != nil {
				a, bb, o := b.own(t)
				fn(t, env{a: a, b: bb, o: o})
				return
			}
			admin := testenv.Pool(t, 3)
			schema := testenv.Schema(t, admin)
			o := testenv.NewCharges(t, admin, schema)
			prefix := testenv.Name("idemseed")
			a, bb := b.make(t, schema, prefix, o)
			fn(t, env{a: a, b: bb, o: o})
		})
	}
}

// collector records which receipt each caller got.
type collector struct {
	mu   sync.Mutex
	seen map[string][]string
}

func (c *collector) add(id, r string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.seen == nil {
		c.seen = map[string][]string{}
	}
	c.seen[id] = append(c.seen[id], r)
}

// Scenario 1: the client times out while the first attempt still runs at a
// slow gateway, and retries. The retry must not charge again, and gets the
// first attempt's receipt.
func TestRetryAfterClientTimeout(t *testing.T) {
	t.Parallel()
	forEachBackend(t, func(t *testing.T, e env) {
		const payments = 20
		var c collector
		var ids []string
		var wg sync.WaitGroup
		var timeouts atomic.Int64
		for i := range payments {
			id := fmt.Sprintf("pay-timeout-%d", i)
			ids = append(ids, id)
			wg.Add(1)
			go func() {
				defer wg.Done()
				server := context.Background() // the server keeps working after the client gives up
				first := make(chan string, 1)
				go func() {
					r, err := e.a.charge(server, id, 4200, 300*time.Millisecond)
					if err != nil {
						t.Errorf("first attempt: %v", err)
					}
					first <- r
				}()
				select {
				case r := <-first: // the client got its answer in time
					c.add(id, r)
					return
				case <-time.After(50 * time.Millisecond):
					timeouts.Add(1) // client timeout: retry with the same key
				}
				r, err := e.a.charge(server, id, 4200, 300*time.Millisecond)
				if err != nil {
					t.Errorf("retry: %v", err)
					return
				}
				c.add(id, r)
				<-first // the first attempt's answer never reached the client
			}()
		}
		wg.Wait()
		if timeouts.Load() == 0 {
			t.Fatal("no client timed out: the scenario did not happen")
		}
		e.o.Check(t, ids, c.seen)
	})
}

// Scenario 2: a double click, 10 and 100 identical requests at once.
func TestDoubleClick(t *testing.T) {
	t.Parallel()
	forEachBackend(t, func(t *testing.T, e env) {
		var c collector
		var ids []string
		for _, clicks := range []int{10, 100} {
			id := fmt.Sprintf("pay-click-%d", clicks)
			ids = append(ids, id)
			doubleClick(t, e.a, id, clicks, &c)
			if len(c.seen[id]) != clicks {
				t.Fatalf("%d of %d clicks got a receipt", len(c.seen[id]), clicks)
			}
		}
		e.o.Check(t, ids, c.seen)
	})
}

func doubleClick(t *testing.T, p payments, id string, clicks int, c *collector) {
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range clicks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			r, err := p.charge(context.Background(), id, 999, 20*time.Millisecond)
			if err != nil {
				t.Errorf("click %d: %v", i, err)
				return
			}
			c.add(id, r)
		}()
	}
	close(start)
	wg.Wait()
}

// naivePayments charges with no idem at all: the control that shows the
// oracle catches duplicates.
type naivePayments struct{ o *testenv.Charges }

func (p *naivePayments) charge(ctx context.Context, id string, amount int64, gateway time.Duration) (string, error) {
	r := testenv.Receipt()
	if err := sleepCtx(ctx, gateway); err != nil {
		return "", err
	}
	_, err := p.o.Pool.Exec(ctx, p.o.Insert(), id, r, amount)
	return r, err
}

// TestOracleCatchesNaive: without idem the double click charges ten times,
// and the oracle says so. A scenario test whose oracle could not fail would
// prove nothing.
func TestOracleCatchesNaive(t *testing.T) {
	t.Parallel()
	admin := testenv.Pool(t, 10)
	o := testenv.NewCharges(t, admin, testenv.Schema(t, admin))
	var c collector
	doubleClick(t, &naivePayments{o}, "pay-naive", 10, &c)
	extra, lost, _, wrong := o.Tally(t, []string{"pay-naive"}, c.seen)
	if extra != 9 || lost != 0 || wrong != 9 {
		t.Fatalf("naive double click: oracle counted %d extra charges and %d wrong receipts, want 9 and 9", extra, wrong)
	}
}

// Scenario 4: the load balancer retries on another instance (own pool, own
// Redis client) while the first still works.
func TestLoadBalancerRetry(t *testing.T) {
	t.Parallel()
	forEachBackend(t, func(t *testing.T, e env) {
		const payments = 30
		var c collector
		var ids []string
		var wg sync.WaitGroup
		for i := range payments {
			id := fmt.Sprintf("pay-lb-%d", i)
			ids = append(ids, id)
			wg.Add(2)
			go func() {
				defer wg.Done()
				r, err := e.a.charge(context.Background(), id, 100, 100*time.Millisecond)
				if err != nil {
					t.Errorf("instance A: %v", err)
					return
				}
				c.add(id, r)
			}()
			go func() {
				defer wg.Done()
				time.Sleep(time.Duration(i%5) * 10 * time.Millisecond)
				r, err := e.b.charge(context.Background(), id, 100, 100*time.Millisecond)
				if err != nil {
					t.Errorf("instance B: %v", err)
					return
				}
				c.add(id, r)
			}()
		}
		wg.Wait()
		for _, id := range ids {
			if len(c.seen[id]) != 2 {
				t.Fatalf("payment %s: %d answers, want 2", id, len(c.seen[id]))
			}
		}
		e.o.Check(t, ids, c.seen)
	})
}

// Scenario 3: a queue redelivers messages whose worker "crashed" before the
// ACK (after the effect committed), and, for the transactional store, also
// those that crashed inside the transaction before commit. Messages go
// through the consumer pipeline; the queue acts on consumer.Result.
func TestQueueRedeliveryAfterCrash(t *testing.T) {
	t.Parallel()
	forEachBackend(t, func(t *testing.T, e env) {
		const payments = 300
		crashBeforeAck := 0.3
		ids := make([]string, payments)
		for i := range ids {
			ids[i] = fmt.Sprintf("pay-q-%d", i)
		}
		var h consumer.Handler
		var midTxCrashes atomic.Int64
		// The metrics must agree with the oracle.
		mp := telemetrytest.NewMetrics(t)
		switch p := e.a.(type) {
		case *txPayments:
			var err error
			h, err = consumer.Transactional(p.store, consumer.TxOptions{Scope: "payments/charge", Telemetry: consumer.Telemetry{MeterProvider: mp}},
				func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
					r := testenv.Receipt()
					if _, err := tx.Exec(ctx, p.o.Insert(), msg.ID, r, 100); err != nil {
						return err
					}
					if chance(0.2) { // crash after the effect, before commit
						midTxCrashes.Add(1)
						return errors.New("worker crashed before commit")
					}
					consumer.SetResult(ctx, []byte(r))
					return nil
				})
			if err != nil {
				t.Fatal(err)
			}
		case *leasePayments:
			mw, err := consumer.Dedup(p.store, consumer.DedupOptions{Scope: "payments/charge", Telemetry: consumer.Telemetry{MeterProvider: mp}})
			if err != nil {
				t.Fatal(err)
			}
			h = consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
				r := testenv.Receipt()
				_, err := p.o.Pool.Exec(ctx, p.o.Insert(), msg.ID, r, 100)
				consumer.SetResult(ctx, []byte(r))
				return err
			}), consumer.Recover(), mw)
		case *sqlPayments:
			h = sqlHandler(t, p, mp, &midTxCrashes)
		}
		h = consumer.Chain(h, consumer.Recover())

		queue := make(chan *consumer.Message, 4*payments)
		for _, id := range ids {
			queue <- &consumer.Message{ID: id, Payload: []byte("100"), Attempt: 1}
		}
		var acked, redelivered, duplicates, calls, dupResults atomic.Int64
		var pending sync.WaitGroup
		pending.Add(payments)
		ctx := context.Background()
		var workers sync.WaitGroup
		for range 4 {
			workers.Add(1)
			go func() {
				defer workers.Done()
				for msg := range queue {
					res := consumer.Process(ctx, h, msg)
					calls.Add(1)
					if res.Duplicate {
						dupResults.Add(1)
					}
					if res.Action == consumer.ActionAck && !chance(crashBeforeAck) {
						acked.Add(1)
						if res.Duplicate {
							duplicates.Add(1)
						}
						pending.Done()
						continue
					}
					if res.Action == consumer.ActionDeadLetter {
						t.Errorf("message %s dead-lettered: %v", msg.ID, res.Err)
						pending.Done()
						continue
					}
					// Crash before ACK, or a retry: the broker redelivers.
					redelivered.Add(1)
					queue <- &consumer.Message{ID: msg.ID, Payload: msg.Payload, Attempt: msg.Attempt + 1, Redelivered: true}
				}
			}()
		}
		pending.Wait()
		close(queue)
		workers.Wait()
		if redelivered.Load() == 0 || duplicates.Load() == 0 {
			t.Fatalf("redelivered=%d duplicates=%d: the scenario did not happen", redelivered.Load(), duplicates.Load())
		}
		t.Logf("%d acked, %d redeliveries, %d acked as duplicates, %d crashes inside the transaction",
			acked.Load(), redelivered.Load(), duplicates.Load(), midTxCrashes.Load())
		e.o.Check(t, ids, nil)

		scope := telemetry.AttrScope.String("payments/charge")
		claims := func(outcome string) int64 {
			return int64(mp.Sum(telemetry.MetricClaims, scope, telemetry.AttrOutcome.String(outcome)))
		}
		handled := func(outcome string) int64 {
			return int64(mp.Sum(telemetry.MetricHandlerDuration, scope, telemetry.AttrOutcome.String(outcome)))
		}
		// Every claim that won either committed its one effect or rolled
		// back with the crash inside the transaction.
		if got, want := claims(telemetry.ClaimFirst), int64(payments)+midTxCrashes.Load(); got != want {
			t.Errorf("idem.claims{first} = %d, want %d (effects + rolled-back crashes)", got, want)
		}
		if got := handled("completed"); got != payments {
			t.Errorf("idem.handler.duration{completed} count = %d, want %d (one per effect)", got, payments)
		}
		if got, want := handled("released"), midTxCrashes.Load(); got != want {
			t.Errorf("idem.handler.duration{released} count = %d, want %d", got, want)
		}
		if got, want := claims(telemetry.ClaimDuplicate), dupResults.Load(); got != want {
			t.Errorf("idem.claims{duplicate} = %d, want %d duplicate results", got, want)
		}
		if got, want := int64(mp.Sum(telemetry.MetricClaims, scope)), calls.Load(); got != want {
			t.Errorf("idem.claims in all = %d, want %d deliveries", got, want)
		}
		mp.NoValueContains("pay-q-")
	})
}

func chance(p float64) bool {
	n, _ := rand.Int(rand.Reader, big.NewInt(1_000_000))
	return float64(n.Int64()) < p*1_000_000
}
