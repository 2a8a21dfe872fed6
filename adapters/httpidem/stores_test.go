package httpidem_test

// Behaviour that depends on the store: PostgreSQL (transactional and lease)
// and Redis.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/dedup/twolevel"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// pgWorld is a transactional middleware on a fresh schema.
type pgWorld struct {
	o      *testenv.Charges
	store  *pgtable.Store
	schema string
}

func newPGWorld(t *testing.T, maxConns int32, params map[string]string) pgWorld {
	t.Helper()
	pool := testenv.PoolWith(t, maxConns, params)
	schema := testenv.Schema(t, pool)
	return pgWorld{o: testenv.NewCharges(t, pool, schema), store: pgStore(t, pool, schema), schema: schema}
}

func (w pgWorld) keys(t *testing.T) int {
	t.Helper()
	var n int
	if err := w.o.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+w.store.Table()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func (w pgWorld) server(t *testing.T, p *payments, opts httpidem.Options) *httptest.Server {
	t.Helper()
	mw, err := httpidem.NewTx(w.store, opts)
	if err != nil {
		t.Fatal(err)
	}
	if p.o == nil {
		p.o = w.o
	}
	return quietServer(t, mw.Handler(p))
}

func TestTxRequestRules(t *testing.T) {
	t.Parallel()
	w := newPGWorld(t, 5, nil)
	principal := func(r *http.Request) string { return r.Header.Get("X-User") }
	srv := w.server(t, &payments{}, httpidem.Options{Principal: principal})
	as := func(user string, rq req) req { rq.header = map[string]string{"X-User": user}; return rq }

	// No key → 400, nothing stored.
	if r := do(t, nil, srv.URL, as("alice", req{body: `{"id":"p1","amount":1}`})); r.status != http.StatusBadRequest {
		t.Fatalf("no key: %d", r.status)
	}
	// Two principals, one key → two payments.
	alice := do(t, nil, srv.URL, as("alice", req{key: "shared", body: `{"id":"pay-alice","amount":100}`}))
	bob := do(t, nil, srv.URL, as("bob", req{key: "shared", body: `{"id":"pay-bob","amount":100}`}))
	if alice.status != http.StatusCreated || bob.status != http.StatusCreated || bob.replayed() {
		t.Fatalf("alice %d, bob %d replayed=%v", alice.status, bob.status, bob.replayed())
	}
	// Same key, other body → 422.
	r := do(t, nil, srv.URL, as("alice", req{key: "shared", body: `{"id":"pay-alice","amount":999}`}))
	if r.status != http.StatusUnprocessableEntity || r.problem(t).Type != problemKeyReused {
		t.Fatalf("other body: %d %s", r.status, r.body)
	}
	var c collector
	c.add(t, "pay-alice", alice)
	c.add(t, "pay-bob", bob)
	c.add(t, "pay-alice", do(t, nil, srv.URL, as("alice", req{key: "shared", body: `{"id":"pay-alice","amount":100}`})))
	w.o.Check(t, []string{"pay-alice", "pay-bob"}, c.seen)
}

func TestBodyTooLargeStoresNothing(t *testing.T) {
	t.Parallel()
	w := newPGWorld(t, 4, nil)
	big := `{"id":"big","amount":1,"pad":"` + strings.Repeat("x", 10<<20) + `"}`
	check := func(name string, url string) {
		r := do(t, nil, url, req{key: "big-" + name, body: big})
		if r.status != http.StatusRequestEntityTooLarge {
			t.Fatalf("%s: 10 MB body: %d", name, r.status)
		}
	}
	p := &payments{}
	check("tx", w.server(t, p, httpidem.Options{}).URL)
	lease, err := httpidem.New(w.store.Lease(), httpidem.Options{})
	if err != nil {
		t.Fatal(err)
	}
	check("lease", quietServer(t, lease.Handler(p)).URL)
	prefix := testenv.Name("httpidem")
	rs := redisStore(t, prefix)
	redisMW, err := httpidem.New(rs, httpidem.Options{})
	if err != nil {
		t.Fatal(err)
	}
	check("redis", quietServer(t, redisMW.Handler(p)).URL)

	if n := w.keys(t); n != 0 {
		t.Fatalf("%d keys stored in PostgreSQL", n)
	}
	keys, err := testenv.Redis(t).Keys(context.Background(), prefix+"*").Result()
	if err != nil || len(keys) != 0 {
		t.Fatalf("Redis keys %v, %v", keys, err)
	}
	if p.calls.Load() != 0 || w.o.Count(t) != 0 {
		t.Fatalf("handler ran %d times, %d charges", p.calls.Load(), w.o.Count(t))
	}
}

// A handler that panics before writing, on every store: the key is given
// back, the client's retry runs the handler, one charge.
func TestPanicReleasesKeyOnEveryStore(t *testing.T) {
	t.Parallel()
	forEachBackend(t, func(t *testing.T, w world) {
		srv, p := w.start(0, httpidem.Options{})
		p.panics.Store(1)
		if _, err := send(context.Background(), nil, srv.URL, payReq("pay-panic")); err == nil {
			t.Fatal("the panicking request got a response")
		}
		r := do(t, nil, srv.URL, payReq("pay-panic"))
		if r.status != http.StatusCreated || r.replayed() {
			t.Fatalf("retry after the panic: %d replayed=%v %s", r.status, r.replayed(), r.body)
		}
		var c collector
		c.add(t, "pay-panic", r)
		c.add(t, "pay-panic", do(t, nil, srv.URL, payReq("pay-panic")))
		if p.calls.Load() != 2 {
			t.Fatalf("handler ran %d times, want 2", p.calls.Load())
		}
		w.o.Check(t, []string{"pay-panic"}, c.seen)
	})
}

// A statement of the handler fails: the transaction is aborted, nothing
// commits, the handler's error answer is sent but not stored, and the retry
// runs.
func TestTxFailedStatementIsNotStored(t *testing.T) {
	t.Parallel()
	w := newPGWorld(t, 3, nil)
	var calls atomic.Int64
	h := http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		tx := httpidem.Tx[pgx.Tx](r.Context())
		if calls.Add(1) == 1 {
			if _, err := tx.Exec(r.Context(), w.o.Insert(), "pay-fail", "rcpt", 1); err != nil {
				t.Error(err)
			}
			_, err := tx.Exec(r.Context(), "INSERT INTO no_such_table VALUES (1)")
			http.Error(rw, fmt.Sprint("database: ", err), http.StatusInternalServerError)
			return
		}
		if _, err := tx.Exec(r.Context(), w.o.Insert(), "pay-fail", "rcpt-2", 1); err != nil {
			t.Error(err)
		}
		rw.WriteHeader(http.StatusCreated)
	})
	mw, err := httpidem.NewTx(w.store, httpidem.Options{})
	if err != nil {
		t.Fatal(err)
	}
	srv := quietServer(t, mw.Handler(h))
	if r := do(t, nil, srv.URL, req{key: "f", body: "{}"}); r.status != http.StatusInternalServerError {
		t.Fatalf("first: %d", r.status)
	}
	if n := w.keys(t); n != 0 {
		t.Fatalf("%d keys committed by an aborted transaction", n)
	}
	if r := do(t, nil, srv.URL, req{key: "f", body: "{}"}); r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("retry: %d replayed=%v", r.status, r.replayed())
	}
	w.o.Check(t, []string{"pay-fail"}, nil)
}

// An oversized response under a transactional store rolls everything back:
// no charge, no key; the 500 is not stored.
func TestTxResponseTooLargeRollsBack(t *testing.T) {
	t.Parallel()
	w := newPGWorld(t, 3, nil)
	h := http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if _, err := httpidem.Tx[pgx.Tx](r.Context()).Exec(r.Context(), w.o.Insert(), "pay-big", "rcpt", 1); err != nil {
			t.Error(err)
		}
		_, _ = rw.Write(make([]byte, 4096))
	})
	mw, err := httpidem.NewTx(w.store, httpidem.Options{MaxResponseBytes: 1024})
	if err != nil {
		t.Fatal(err)
	}
	srv := quietServer(t, mw.Handler(h))
	for range 2 {
		r := do(t, nil, srv.URL, req{key: "big", body: "{}"})
		if r.status != http.StatusInternalServerError || r.replayed() || r.problem(t).Type != problemResponseTooLarge {
			t.Fatalf("oversized: %d replayed=%v", r.status, r.replayed())
		}
	}
	if w.keys(t) != 0 || w.o.Count(t) != 0 {
		t.Fatalf("%d keys, %d charges after a rolled-back request", w.keys(t), w.o.Count(t))
	}
}

// With lock_timeout set on the pool, a duplicate that waits too long for the
// first transaction in PostgreSQL is answered 409, and the handler's writes
// are the first's only.
func TestTxLockTimeoutAnswers409(t *testing.T) {
	t.Parallel()
	w := newPGWorld(t, 4, map[string]string{"lock_timeout": "200ms"})
	entered, unblock := make(chan struct{}), make(chan struct{})
	var once sync.Once
	p := &payments{}
	blocking := http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		once.Do(func() { close(entered); <-unblock })
		p.ServeHTTP(rw, r)
	})
	mw, err := httpidem.NewTx(w.store, httpidem.Options{})
	if err != nil {
		t.Fatal(err)
	}
	p.o = w.o
	srv := quietServer(t, mw.Handler(blocking))
	first := make(chan response)
	go func() {
		r, _ := send(context.Background(), nil, srv.URL, payReq("pay-lock"))
		first <- r
	}()
	<-entered
	r := do(t, nil, srv.URL, payReq("pay-lock"))
	if r.status != http.StatusConflict || r.header.Get("Retry-After") == "" {
		t.Fatalf("duplicate during a long first transaction: %d %s", r.status, r.body)
	}
	close(unblock)
	a := <-first
	var c collector
	c.add(t, "pay-lock", a)
	c.add(t, "pay-lock", do(t, nil, srv.URL, payReq("pay-lock")))
	w.o.Check(t, []string{"pay-lock"}, c.seen)
}

// The client retries through a server that drops the first response after
// the handler ran (the connection is closed before a byte is sent): one
// payment, the same key on every attempt, and the client gets the replay.
func TestClientRetriesThroughDroppedResponse(t *testing.T) {
	t.Parallel()
	w := newPGWorld(t, 4, nil)
	p := &payments{o: w.o}
	mw, err := httpidem.NewTx(w.store, httpidem.Options{})
	if err != nil {
		t.Fatal(err)
	}
	inner := mw.Handler(p)
	var (
		mu      sync.Mutex
		keys    []string
		dropped atomic.Int64
	)
	srv := quietServer(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		mu.Lock()
		keys = append(keys, r.Header.Get("Idempotency-Key"))
		first := len(keys) == 1
		mu.Unlock()
		if !first {
			inner.ServeHTTP(rw, r)
			return
		}
		inner.ServeHTTP(httptest.NewRecorder(), r) // committed, response lost
		conn, _, err := http.NewResponseController(rw).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		dropped.Add(1)
		_ = conn.Close()
	}))
	base := &http.Transport{DisableKeepAlives: true}
	defer base.CloseIdleConnections()
	tr, err := httpidem.NewTransport(httpidem.TransportOptions{Base: base, Backoff: consumer.Backoff{Initial: time.Millisecond, Max: 10 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	body := `{"id":"pay-drop","amount":700}`
	rq, err := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := (&http.Client{Transport: tr}).Do(rq)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusCreated || resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("after the dropped response: %d replayed=%q %s", resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), b)
	}
	mu.Lock()
	defer mu.Unlock()
	if dropped.Load() != 1 || len(keys) < 2 {
		t.Fatalf("dropped %d responses, %d attempts", dropped.Load(), len(keys))
	}
	for _, k := range keys {
		if k != keys[0] || k == "" {
			t.Fatalf("keys differ between attempts: %q", keys)
		}
	}
	if _, err := httpidem.ParseKey(keys[0], 0); err != nil {
		t.Fatalf("the client sent an invalid key %q: %v", keys[0], err)
	}
	var got paid
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	w.o.Check(t, []string{"pay-drop"}, map[string][]string{"pay-drop": {got.Receipt}})
	t.Logf("%d attempts with key %s", len(keys), keys[0])
}

// A transactional store's failure after the handler ran (here: the
// connection is killed mid-transaction) answers 503 and stores nothing.
func TestTxStoreFailureAnswers503(t *testing.T) {
	t.Parallel()
	w := newPGWorld(t, 3, nil)
	h := http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		tx := httpidem.Tx[pgx.Tx](r.Context())
		var pid int
		if err := tx.QueryRow(r.Context(), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			t.Error(err)
		}
		if _, err := w.o.Pool.Exec(context.Background(), "SELECT pg_terminate_backend($1)", pid); err != nil {
			t.Error(err)
		}
		rw.WriteHeader(http.StatusCreated)
	})
	mw, err := httpidem.NewTx(w.store, httpidem.Options{})
	if err != nil {
		t.Fatal(err)
	}
	srv := quietServer(t, mw.Handler(h))
	r := do(t, nil, srv.URL, req{key: "killed", body: "{}"})
	if r.status != http.StatusServiceUnavailable || r.problem(t).Type != problemStoreUnavailable {
		t.Fatalf("connection killed: %d %s", r.status, r.body)
	}
	if w.keys(t) != 0 {
		t.Fatal("a key was stored")
	}
}

// The connection breaks during COMMIT after PostgreSQL committed: a proxy
// between the store and PostgreSQL forwards the commit and swallows the
// reply. The middleware reads how the transaction ended on a new connection
// and replays the committed payment instead of answering 503 ("nothing
// happened"), and the payment is charged once. When PostgreSQL cannot be
// reached for that read either, the 503 says the outcome is unknown, a retry
// while it is still out of reach says the earlier request's outcome is
// unknown, and a retry once it is back replays the payment.
func TestTxCommitReplyLostReplaysCommitted(t *testing.T) {
	t.Parallel()
	t.Run("read", func(t *testing.T) { lostCommitReply(t, true) })
	t.Run("unreachable", func(t *testing.T) { lostCommitReply(t, false) })
}

func lostCommitReply(t *testing.T, readable bool) {
	direct := testenv.Pool(t, 2)
	schema := testenv.Schema(t, direct)
	o := testenv.NewCharges(t, direct, schema)
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	px, err := fault.NewProxy(net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = px.Close() })
	host, port, _ := net.SplitHostPort(px.Addr())
	p, _ := strconv.ParseUint(port, 10, 16)
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = host, uint16(p)
	cfg.MaxConns = 1 // the outcome is read on a new connection
	var cutting atomic.Bool
	cfg.BeforeConnect = func(context.Context, *pgx.ConnConfig) error {
		// The connection of the cut COMMIT is gone: a new one passes
		// (or, unreadable, is cut too).
		if cutting.CompareAndSwap(true, false) && readable {
			px.SetMode(fault.Pass, 0)
		}
		return nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	pay := &payments{o: o}
	var cutNext atomic.Bool
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		pay.ServeHTTP(w, r) // the charge, in the request's transaction
		if cutNext.CompareAndSwap(true, false) {
			// The next bytes on the transaction's connection are the
			// commit's: PostgreSQL gets them, the reply is lost.
			cutting.Store(true)
			px.SetMode(fault.Cut, 0)
		}
	})
	mw, err := httpidem.NewTx(pgStore(t, pool, schema), httpidem.Options{})
	if err != nil {
		t.Fatal(err)
	}
	srv := quietServer(t, mw.Handler(h))
	// A first payment prepares the statements on the pool's connection,
	// so that the next commit goes out as one write: its writes and
	// COMMIT, nothing waiting for a reply before them.
	if r := do(t, nil, srv.URL, req{key: "warm-up", body: `{"id":"pay-0","amount":1}`}); r.status != http.StatusCreated {
		t.Fatalf("first payment: %d %s", r.status, r.body)
	}
	cutNext.Store(true)
	body := `{"id":"pay-1","amount":100}`
	r1 := do(t, nil, srv.URL, req{key: "lost-commit", body: body})
	// The proxy counts the cut once it closed the connection.
	eventually(t, "the commit's reply to be cut", func() bool { return px.Stats().Cuts >= 1 })
	if !readable {
		if r1.status != http.StatusServiceUnavailable || !strings.Contains(r1.problem(t).Detail, "unknown") {
			t.Fatalf("outcome unreadable: %d %s; want 503 saying the outcome is unknown", r1.status, r1.body)
		}
		// A retry while PostgreSQL is still out of reach cannot claim the
		// key: its 503 says that this attempt did nothing and that the
		// earlier request's outcome is unknown, not that the request with
		// this key was not processed (it committed).
		r2 := do(t, nil, srv.URL, req{key: "lost-commit", body: body})
		p2 := r2.problem(t)
		if r2.status != http.StatusServiceUnavailable || p2.Type != problemStoreUnavailable {
			t.Fatalf("retry while PostgreSQL is unreachable: %d %s; want 503 %s", r2.status, r2.body, problemStoreUnavailable)
		}
		if !strings.Contains(p2.Detail, "earlier request with this key") || !strings.Contains(p2.Detail, "unknown") ||
			strings.Contains(p2.Detail, "the request was not processed") {
			t.Fatalf("retry while PostgreSQL is unreachable: detail %q; want it to say the earlier request's outcome is unknown", p2.Detail)
		}
		px.SetMode(fault.Pass, 0)
		r1 = do(t, nil, srv.URL, req{key: "lost-commit", body: body})
	}
	if r1.status != http.StatusCreated || !r1.replayed() {
		t.Fatalf("after a commit whose reply was lost: %d %s (replayed %v); want the committed 201 replayed", r1.status, r1.body, r1.replayed())
	}
	if n := o.Count(t); n != 2 {
		t.Fatalf("%d charges, want 2 (pay-0 and pay-1 once)", n)
	}
	r2 := do(t, nil, srv.URL, req{key: "lost-commit", body: body})
	if r2.status != http.StatusCreated || !r2.replayed() || string(r2.body) != string(r1.body) {
		t.Fatalf("retry: %d %s, want the replay of %s", r2.status, r2.body, r1.body)
	}
	if n := pay.calls.Load(); n != 2 {
		t.Fatalf("the handler ran %d times, want 2", n)
	}
}

// A duplicate waiting in PostgreSQL for the first request's transaction gives
// up when its client goes away, and frees its connection; the first request
// is not disturbed.
func TestTxAbandonedWaitFreesConnection(t *testing.T) {
	t.Parallel()
	w := newPGWorld(t, 2, nil) // two connections: the first request's, and one more
	entered, unblock := make(chan struct{}), make(chan struct{})
	var (
		once   sync.Once
		holder int32
	)
	p := &payments{o: w.o}
	mw, err := httpidem.NewTx(w.store, httpidem.Options{})
	if err != nil {
		t.Fatal(err)
	}
	srv := quietServer(t, mw.Handler(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		var in payment
		body, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(body, &in)
		r.Body = io.NopCloser(strings.NewReader(string(body)))
		if in.ID == "pay-held" {
			once.Do(func() {
				// The backend of the first request's transaction, which
				// holds the key.
				if err := httpidem.Tx[pgx.Tx](r.Context()).QueryRow(r.Context(), "SELECT pg_backend_pid()").Scan(&holder); err != nil {
					t.Error(err)
				}
				close(entered)
				<-unblock
			})
		}
		p.ServeHTTP(rw, r)
	})))
	first := make(chan response)
	go func() {
		r, _ := send(context.Background(), nil, srv.URL, payReq("pay-held"))
		first <- r
	}()
	<-entered
	ctx, cancel := context.WithCancel(context.Background())
	dup := make(chan error)
	go func() {
		_, err := send(ctx, nil, srv.URL, payReq("pay-held"))
		dup <- err
	}()
	waitBlockedBy(t, holder, "the duplicate to wait for the first request's transaction")
	cancel() // the duplicate's client gives up
	if err := <-dup; err == nil {
		t.Fatal("the cancelled duplicate got a response")
	}
	// Its connection is back in the pool: another payment goes through
	// while the first still holds the other connection.
	if r := do(t, nil, srv.URL, payReq("pay-other")); r.status != http.StatusCreated {
		t.Fatalf("another payment while the first is held: %d %s", r.status, r.body)
	}
	close(unblock)
	var c collector
	c.add(t, "pay-held", <-first)
	w.o.Check(t, []string{"pay-held", "pay-other"}, c.seen)
}

// A transactional instance and a lease-mode instance on the same pgtable
// table (a deployment moving a route from one mode to the other): the lease
// request for a key whose transactional request runs waits for that
// transaction (its claim is the key's row, written first), then answers with
// a replay of the transactional request's response. One charge.
func TestLeaseRequestWaitsForTxRequest(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	schema := testenv.Schema(t, pool)
	o := testenv.NewCharges(t, pool, schema)
	store := pgStore(t, pool, schema)
	entered, unblock := make(chan struct{}), make(chan struct{})
	var holder int32 // the transactional request's backend
	txPay := &payments{o: o}
	txMW, err := httpidem.NewTx(store, httpidem.Options{})
	if err != nil {
		t.Fatal(err)
	}
	txSrv := quietServer(t, txMW.Handler(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		txPay.ServeHTTP(rw, r) // charges in the request's transaction
		if err := httpidem.Tx[pgx.Tx](r.Context()).QueryRow(r.Context(), "SELECT pg_backend_pid()").Scan(&holder); err != nil {
			t.Error(err)
		}
		close(entered)
		<-unblock
	})))
	leasePay := &payments{o: o, pool: pool}
	leaseSrv := quietServer(t, newMW(t, store.Lease(), httpidem.Options{}).Handler(leasePay))

	first := make(chan response, 1)
	go func() {
		r, err := send(context.Background(), nil, txSrv.URL, payReq("pay-mixed"))
		if err != nil {
			t.Error(err)
		}
		first <- r
	}()
	<-entered
	second := make(chan response, 1)
	go func() {
		r, err := send(context.Background(), nil, leaseSrv.URL, payReq("pay-mixed"))
		if err != nil {
			t.Error(err)
		}
		second <- r
	}()
	waitBlockedBy(t, holder, "the lease request to wait for the transactional one")
	close(unblock)
	r1, r2 := <-first, <-second
	if r1.status != http.StatusCreated || r1.replayed() {
		t.Fatalf("transactional request: %d replayed=%v %s; want 201, run", r1.status, r1.replayed(), r1.body)
	}
	if r2.status != http.StatusCreated || !r2.replayed() || string(r2.body) != string(r1.body) {
		t.Fatalf("lease request that waited: %d replayed=%v %s; want a replay of %s", r2.status, r2.replayed(), r2.body, r1.body)
	}
	if n := leasePay.calls.Load(); n != 0 {
		t.Fatalf("the lease instance's handler ran %d times, want 0", n)
	}
	var got paid
	if err := json.Unmarshal(r1.body, &got); err != nil {
		t.Fatal(err)
	}
	o.Check(t, []string{"pay-mixed"}, map[string][]string{"pay-mixed": {got.Receipt}})
}

// waitBlockedBy waits until one session waits for a lock that the session
// pid holds (here, for its transaction).
func waitBlockedBy(t *testing.T, pid int32, what string) {
	t.Helper()
	admin := testenv.Pool(t, 1)
	eventually(t, what, func() bool {
		var n int
		_ = admin.QueryRow(context.Background(),
			`SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY (pg_blocking_pids(pid))`, pid).Scan(&n)
		return n == 1
	})
}

// A twolevel store whose cache (Redis) is unreachable for a moment after the
// payment committed keeps the key's Redis lease live, its Complete having
// failed. The retry of the paid request is the replay of its 201, from the
// committed row in PostgreSQL, not a 409 "in progress" for as long as the
// lease lasts; the payment is charged once.
func TestTwoLevelFailedCacheCompleteReplays(t *testing.T) {
	t.Parallel()
	direct := testenv.Redis(t)
	prefix := testenv.Name("httpidem2l")
	t.Cleanup(func() { // the lease the failed Complete left
		keys, err := direct.Keys(context.Background(), prefix+":*").Result()
		if err == nil && len(keys) > 0 {
			err = direct.Del(context.Background(), keys...).Err()
		}
		if err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	o := testenv.NewCharges(t, pool, schema)
	px, err := fault.NewProxy(testenv.RedisAddr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = px.Close() })
	rdb := redis.NewClient(&redis.Options{Addr: px.Addr(), MaxRetries: -1, DialerRetries: 1})
	t.Cleanup(func() { _ = rdb.Close() })
	cache, err := redisnx.New(rdb, redisnx.Options{Prefix: prefix}) // the default 30s lease
	if err != nil {
		t.Fatal(err)
	}
	store, err := twolevel.New(cache, pgStore(t, pool, schema), twolevel.Options{CacheTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	mw, err := httpidem.NewTx(store, httpidem.Options{})
	if err != nil {
		t.Fatal(err)
	}
	pay := &payments{o: o}
	var cutNext atomic.Bool
	srv := quietServer(t, mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		pay.ServeHTTP(w, r) // the charge, in the request's transaction
		if cutNext.Load() {
			px.SetMode(fault.Reset, 0) // the commit goes through; the cache's Complete fails
		}
	})))
	body := `{"id":"pay-1","amount":100}`
	cutNext.Store(true)
	r1 := do(t, nil, srv.URL, req{key: "cache-cut", body: body})
	cutNext.Store(false)
	px.SetMode(fault.Pass, 0)
	if r1.status != http.StatusCreated {
		t.Fatalf("first payment: %d %s", r1.status, r1.body)
	}
	r2 := do(t, nil, srv.URL, req{key: "cache-cut", body: body})
	if r2.status != http.StatusCreated || !r2.replayed() || string(r2.body) != string(r1.body) {
		t.Fatalf("retry after the cache's Complete failed: %d %s (replayed %v); want the replay of %s", r2.status, r2.body, r2.replayed(), r1.body)
	}
	if n := o.Count(t); n != 1 {
		t.Fatalf("%d charges, want 1", n)
	}
	if n := pay.calls.Load(); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
}
