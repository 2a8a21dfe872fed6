package httpidem_test

// The four double-payment scenarios over HTTP (a retry after a client
// timeout, a double click, a queue redelivery, a load balancer retry), against every store the
// middleware runs on, each ending with the oracle: charges go to a table with
// no unique constraint, so a duplicate effect shows up as a second row.

import (
	"github.com/jackc/pgx/v5"

	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/dedup/twolevel"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/pgbouncer"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// payments is the payment endpoint: it charges (a row in the oracle) and
// answers 201 with the receipt. Under a transactional middleware the charge
// is written in the request's transaction; under a lease it is an effect of
// its own (the oracle insert stands for a call to a payment provider).
type payments struct {
	o       *testenv.Charges
	pool    *pgxpool.Pool // the instance's own pool
	gateway time.Duration // how long the provider takes, after the charge
	calls   atomic.Int64
	panics  atomic.Int64 // panic on this many next calls
}

type payment struct {
	ID     string `json:"id"`
	Amount int64  `json:"amount"`
}

type paid struct {
	ID      string `json:"id"`
	Receipt string `json:"receipt"`
}

func (p *payments) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.calls.Add(1)
	var in payment
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.ID == "" || in.Amount <= 0 {
		httpidem.Release(r.Context())
		http.Error(w, "bad payment", http.StatusBadRequest)
		return
	}
	if p.panics.Load() > 0 && p.panics.Add(-1) >= 0 {
		panic("crash before the charge")
	}
	rc := testenv.Receipt()
	ctx := r.Context()
	var err error
	if tx := httpidem.Tx[pgx.Tx](ctx); tx != nil {
		_, err = tx.Exec(ctx, p.o.Insert(), in.ID, rc, in.Amount)
	} else {
		_, err = p.pool.Exec(ctx, p.o.Insert(), in.ID, rc, in.Amount)
	}
	if err != nil {
		httpidem.Release(ctx) // nothing was charged
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	time.Sleep(p.gateway)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/payments/"+in.ID)
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(paid{ID: in.ID, Receipt: rc})
}

// backend builds one server instance (own pool, own Redis client, as two
// servers behind a load balancer have) on stores shared through PostgreSQL
// or Redis (memstore: shared in the process). store is its idem.store.
type backend struct {
	name     string
	store    string
	instance func(t *testing.T, schema, prefix string, opts httpidem.Options) (*httpidem.Middleware, *pgxpool.Pool)
}

// memStores are the memstore backend's stores, one per world (prefix), so
// that two instances of one world share theirs.
var memStores sync.Map

func pgStore(t *testing.T, pool *pgxpool.Pool, schema string) *pgtable.Store {
	t.Helper()
	s, err := pgtable.New(pool, pgtable.Options{Schema: schema, Retention: 24 * time.Hour, Lease: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s
}

func redisStore(t *testing.T, prefix string) *redisnx.Store {
	t.Helper()
	s, err := redisnx.New(testenv.Redis(t), redisnx.Options{Prefix: prefix, Lease: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func mustMW(t *testing.T) func(*httpidem.Middleware, error) *httpidem.Middleware {
	return func(m *httpidem.Middleware, err error) *httpidem.Middleware {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
}

var backends = []backend{
	{"memstore", "memstore", func(t *testing.T, _, prefix string, opts httpidem.Options) (*httpidem.Middleware, *pgxpool.Pool) {
		s, loaded := memStores.LoadOrStore(prefix, newMem(t, memstore.Options{}))
		if !loaded {
			t.Cleanup(func() { memStores.Delete(prefix) })
		}
		return mustMW(t)(httpidem.New(s.(*memstore.Store), opts)), testenv.Pool(t, 5)
	}},
	{"pgtable_tx", "pgtable", func(t *testing.T, schema, _ string, opts httpidem.Options) (*httpidem.Middleware, *pgxpool.Pool) {
		pool := testenv.Pool(t, 5)
		return mustMW(t)(httpidem.NewTx(pgStore(t, pool, schema), opts)), pool
	}},
	{"pgtable_lease", "pgtable", func(t *testing.T, schema, _ string, opts httpidem.Options) (*httpidem.Middleware, *pgxpool.Pool) {
		pool := testenv.Pool(t, 5)
		return mustMW(t)(httpidem.New(pgStore(t, pool, schema).Lease(), opts)), pool
	}},
	// Each instance through a PgBouncer of its own in transaction mode (a
	// sidecar), in front of the same database.
	{"pgtable_tx_pgbouncer", "pgtable", func(t *testing.T, schema, _ string, opts httpidem.Options) (*httpidem.Middleware, *pgxpool.Pool) {
		pool := pgbouncer.New(t, pgbouncer.Options{}).Pool(t, 5)
		return mustMW(t)(httpidem.NewTx(pgStore(t, pool, schema), opts)), pool
	}},
	{"pgtable_lease_pgbouncer", "pgtable", func(t *testing.T, schema, _ string, opts httpidem.Options) (*httpidem.Middleware, *pgxpool.Pool) {
		pool := pgbouncer.New(t, pgbouncer.Options{}).Pool(t, 5)
		return mustMW(t)(httpidem.New(pgStore(t, pool, schema).Lease(), opts)), pool
	}},
	{"redisnx", "redisnx", func(t *testing.T, _, prefix string, opts httpidem.Options) (*httpidem.Middleware, *pgxpool.Pool) {
		pool := testenv.Pool(t, 5)
		return mustMW(t)(httpidem.New(redisStore(t, prefix), opts)), pool
	}},
	{"twolevel_tx", "twolevel", func(t *testing.T, schema, prefix string, opts httpidem.Options) (*httpidem.Middleware, *pgxpool.Pool) {
		pool := testenv.Pool(t, 5)
		s, err := twolevel.New(redisStore(t, prefix), pgStore(t, pool, schema), twolevel.Options{})
		if err != nil {
			t.Fatal(err)
		}
		return mustMW(t)(httpidem.NewTx(s, opts)), pool
	}},
}

// world is one backend's setup: an oracle and a way to start instances,
// whose middlewares all report to mp; requests counts the requests the
// instances received.
type world struct {
	o        *testenv.Charges
	mp       *telemetrytest.Metrics
	store    string
	requests *atomic.Int64
	start    func(gateway time.Duration, opts httpidem.Options) (*httptest.Server, *payments)
}

func forEachBackend(t *testing.T, fn func(t *testing.T, w world)) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			admin := testenv.Pool(t, 2)
			schema := testenv.Schema(t, admin)
			o := testenv.NewCharges(t, admin, schema)
			prefix := testenv.Name("httpidem")
			mp := telemetrytest.NewMetrics(t)
			requests := new(atomic.Int64)
			fn(t, world{o: o, mp: mp, store: b.store, requests: requests, start: func(gateway time.Duration, opts httpidem.Options) (*httptest.Server, *payments) {
				opts.MeterProvider = mp
				mw, pool := b.instance(t, schema, prefix, opts)
				p := &payments{o: o, pool: pool, gateway: gateway}
				h := mw.Handler(p)
				return quietServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					requests.Add(1)
					h.ServeHTTP(w, r)
				})), p
			}})
		})
	}
}

// checkMetrics checks the metrics against the oracle and the requests the
// instances received: as many first claims and completed handlers as
// charges, every other request a duplicate (replayed), in flight (409) or a
// store error (503, a client that left before its claim), each counted
// once; replays and first requests acknowledged, the others to retry; no
// key in any attribute.
func (w world) checkMetrics(t *testing.T) {
	t.Helper()
	mp := w.mp
	requests := float64(w.requests.Load())
	// A request's metrics are recorded after its answer is written: wait
	// for the last ones.
	eventually(t, "every request counted", func() bool { return mp.Sum(telemetry.MetricMessages) == requests })
	attrs := []attribute.KeyValue{telemetry.AttrScope.String(http.MethodPost), telemetry.AttrStore.String(w.store)}
	claims := func(o string) float64 {
		return mp.Sum(telemetry.MetricClaims, append(attrs, telemetry.AttrOutcome.String(o))...)
	}
	msgs := func(result string) float64 {
		return mp.Sum(telemetry.MetricMessages, telemetry.AttrSystem.String("http"), telemetry.AttrDestination.String(http.MethodPost), telemetry.AttrResult.String(result))
	}
	first, dup, inFlight, failed := claims(telemetry.ClaimFirst), claims(telemetry.ClaimDuplicate), claims(telemetry.ClaimInFlight), claims(telemetry.ClaimError)
	charges := float64(w.o.Count(t))
	completed := mp.Sum(telemetry.MetricHandlerDuration, append(attrs, telemetry.AttrOutcome.String("completed"))...)
	if first != charges || completed != charges {
		t.Errorf("claims{first} = %v, handler{completed} = %v; the oracle counted %v charges", first, completed, charges)
	}
	if all := mp.Sum(telemetry.MetricClaims); first+dup+inFlight+failed != requests || all != requests {
		t.Errorf("claims: first %v + duplicate %v + in_flight %v + error %v (all outcomes %v); the instances got %v requests",
			first, dup, inFlight, failed, all, requests)
	}
	if msgs("ack") != first+dup || msgs("retry") != inFlight+failed || msgs("dead_letter") != 0 {
		t.Errorf("messages: ack %v, retry %v, dead_letter %v; want %v, %v, 0", msgs("ack"), msgs("retry"), msgs("dead_letter"), first+dup, inFlight+failed)
	}
	mp.NoValueContains("pay-")
	t.Logf("metrics: %v requests: %v first, %v duplicate, %v in flight, %v error", requests, first, dup, inFlight, failed)
}

// collector records the receipts clients got, per payment.
type collector struct {
	mu   sync.Mutex
	seen map[string][]string
}

func (c *collector) add(t testing.TB, id string, r response) {
	var got paid
	if err := json.Unmarshal(r.body, &got); err != nil || got.ID != id {
		t.Errorf("payment %s: status %d, body %q", id, r.status, r.body)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.seen == nil {
		c.seen = map[string][]string{}
	}
	c.seen[id] = append(c.seen[id], got.Receipt)
}

func payReq(id string) req {
	return req{key: id, body: fmt.Sprintf(`{"id":%q,"amount":4200}`, id)}
}

// retryingClient is a client through httpidem.Transport.
func retryingClient(t testing.TB) *http.Client {
	t.Helper()
	tr, err := httpidem.NewTransport(httpidem.TransportOptions{
		MaxAttempts: 100, MaxElapsed: time.Minute, Backoff: consumer.Backoff{Initial: 5 * time.Millisecond, Max: 50 * time.Millisecond},
	})
	if err != nil {
		t.Fatal(err)
	}
	return &http.Client{Transport: tr}
}

// Scenario 1: the client times out while the first attempt still runs at a
// slow gateway, and retries with the same key. The retry must not charge
// again and gets the first attempt's receipt.
func TestScenarioRetryAfterClientTimeout(t *testing.T) {
	t.Parallel()
	forEachBackend(t, func(t *testing.T, w world) {
		srv, p := w.start(300*time.Millisecond, httpidem.Options{})
		client := retryingClient(t)
		const n = 20
		var (
			c        collector
			ids      []string
			wg       sync.WaitGroup
			timeouts atomic.Int64
		)
		for i := range n {
			id := fmt.Sprintf("pay-timeout-%d", i)
			ids = append(ids, id)
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
				defer cancel()
				r, err := send(ctx, nil, srv.URL, payReq(id))
				if err == nil {
					c.add(t, id, r) // answered in time
					return
				}
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("first attempt: %v", err)
					return
				}
				timeouts.Add(1)
				r, err = send(context.Background(), client, srv.URL, payReq(id))
				if err != nil || r.status != http.StatusCreated {
					t.Errorf("retry: %v %d %s", err, r.status, r.body)
					return
				}
				c.add(t, id, r)
			})
		}
		wg.Wait()
		if timeouts.Load() == 0 {
			t.Fatal("no client timed out: the scenario did not happen")
		}
		if calls := p.calls.Load(); calls != n {
			t.Fatalf("the handler ran %d times for %d payments", calls, n)
		}
		w.o.Check(t, ids, c.seen)
		w.checkMetrics(t)
	})
}

// Scenario 2: a double click, 10 and 100 identical requests at once. One
// charge; every other request gets the replay or 409.
func TestScenarioDoubleClick(t *testing.T) {
	t.Parallel()
	forEachBackend(t, func(t *testing.T, w world) {
		srv, _ := w.start(20*time.Millisecond, httpidem.Options{})
		var c collector
		var ids []string
		for _, clicks := range []int{10, 100} {
			id := fmt.Sprintf("pay-click-%d", clicks)
			ids = append(ids, id)
			var first, replays, conflicts atomic.Int64
			start := make(chan struct{})
			var wg sync.WaitGroup
			for range clicks {
				wg.Go(func() {
					<-start
					r, err := send(context.Background(), nil, srv.URL, payReq(id))
					switch {
					case err != nil:
						t.Errorf("click: %v", err)
					case r.status == http.StatusConflict:
						conflicts.Add(1)
					case r.status == http.StatusCreated && r.replayed():
						replays.Add(1)
						c.add(t, id, r)
					case r.status == http.StatusCreated:
						first.Add(1)
						c.add(t, id, r)
					default:
						t.Errorf("click: %d %s", r.status, r.body)
					}
				})
			}
			close(start)
			wg.Wait()
			if first.Load() != 1 || first.Load()+replays.Load()+conflicts.Load() != int64(clicks) {
				t.Fatalf("%d clicks: %d first, %d replays, %d conflicts", clicks, first.Load(), replays.Load(), conflicts.Load())
			}
			t.Logf("%d clicks: 1 charge, %d replays, %d answered 409", clicks, replays.Load(), conflicts.Load())
		}
		w.o.Check(t, ids, c.seen)
		w.checkMetrics(t)
	})
}

// Scenario 3 (over HTTP): the replay after completion, many times over.
func TestScenarioReplayAfterCompletion(t *testing.T) {
	t.Parallel()
	forEachBackend(t, func(t *testing.T, w world) {
		srv, p := w.start(0, httpidem.Options{})
		var c collector
		var ids []string
		for i := range 10 {
			id := fmt.Sprintf("pay-replay-%d", i)
			ids = append(ids, id)
			first := do(t, nil, srv.URL, payReq(id))
			if first.status != http.StatusCreated || first.replayed() {
				t.Fatalf("first: %d", first.status)
			}
			c.add(t, id, first)
			for range 5 {
				again := do(t, nil, srv.URL, payReq(id))
				if again.status != http.StatusCreated || !again.replayed() || again.header.Get("Location") != "/payments/"+id {
					t.Fatalf("replay: %d replayed=%v %v", again.status, again.replayed(), again.header)
				}
				c.add(t, id, again)
			}
		}
		if p.calls.Load() != 10 {
			t.Fatalf("handler ran %d times for 10 payments", p.calls.Load())
		}
		w.o.Check(t, ids, c.seen)
		w.checkMetrics(t)
	})
}

// Scenario 4: the load balancer retries on another instance (its own pool
// and Redis client) while the first still works.
func TestScenarioLoadBalancerRetry(t *testing.T) {
	t.Parallel()
	forEachBackend(t, func(t *testing.T, w world) {
		a, _ := w.start(100*time.Millisecond, httpidem.Options{})
		b, _ := w.start(100*time.Millisecond, httpidem.Options{})
		client := retryingClient(t)
		const n = 30
		var (
			c   collector
			ids []string
			wg  sync.WaitGroup
		)
		for i := range n {
			id := fmt.Sprintf("pay-lb-%d", i)
			ids = append(ids, id)
			wg.Go(func() {
				r, err := send(context.Background(), client, a.URL, payReq(id))
				if err != nil || r.status != http.StatusCreated {
					t.Errorf("instance A: %v %d", err, r.status)
					return
				}
				c.add(t, id, r)
			})
			wg.Go(func() {
				time.Sleep(time.Duration(i%5) * 10 * time.Millisecond)
				r, err := send(context.Background(), client, b.URL, payReq(id))
				if err != nil || r.status != http.StatusCreated {
					t.Errorf("instance B: %v %d", err, r.status)
					return
				}
				c.add(t, id, r)
			})
		}
		wg.Wait()
		for _, id := range ids {
			if len(c.seen[id]) != 2 {
				t.Fatalf("payment %s: %d answers, want 2", id, len(c.seen[id]))
			}
		}
		w.o.Check(t, ids, c.seen)
		w.checkMetrics(t)
	})
}

// TestOracleCatchesNaive: without the middleware a double click charges ten
// times, and the oracle says so. An oracle that could not fail would prove
// nothing.
func TestOracleCatchesNaive(t *testing.T) {
	t.Parallel()
	admin := testenv.Pool(t, 3)
	o := testenv.NewCharges(t, admin, testenv.Schema(t, admin))
	srv := quietServer(t, &payments{o: o, pool: admin, gateway: 10 * time.Millisecond})
	var c collector
	var wg sync.WaitGroup
	for range 10 {
		wg.Go(func() {
			r, err := send(context.Background(), nil, srv.URL, payReq("pay-naive"))
			if err != nil {
				t.Error(err)
				return
			}
			c.add(t, "pay-naive", r)
		})
	}
	wg.Wait()
	extra, lost, _, wrong := o.Tally(t, []string{"pay-naive"}, c.seen)
	if extra != 9 || lost != 0 || wrong != 9 {
		t.Fatalf("naive double click: the oracle counted %d extra charges and %d wrong receipts, want 9 and 9", extra, wrong)
	}
}
