package chaos

import (
	"github.com/jackc/pgx/v5"

	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
)

// HTTP SIGKILL cells: two server processes with adapters/httpidem's
// Idempotency-Key middleware (NewTx on pgtable, New on redisnx) behind a
// client in the runner that sends every request with the same key until it
// gets its 201, each attempt to one of the two servers at random (a load
// balancer retrying on another instance), through httpidem's retrying
// Transport. An input is acknowledged when its 201 arrived.

const httpWorkers = 8

// httpWorkload drives the HTTP client.
type httpWorkload struct {
	b      *cellBase
	addrs  []string
	jobs   chan string
	acked  atomic.Int64
	client *http.Client
	base   *http.Transport
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu  sync.Mutex
	err error
}

// freeAddrs returns n loopback addresses nothing listens on right now.
func freeAddrs(n int) ([]string, error) {
	out := make([]string, 0, n)
	lns := make([]net.Listener, 0, n)
	defer func() {
		for _, l := range lns {
			_ = l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		lns = append(lns, l)
		out = append(out, l.Addr().String())
	}
	return out, nil
}

// lbTransport sends each attempt to one of the servers at random.
type lbTransport struct {
	base  http.RoundTripper
	addrs []string
	mu    sync.Mutex
	rng   *rand.Rand
}

func (t *lbTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	t.mu.Lock()
	addr := t.addrs[t.rng.IntN(len(t.addrs))]
	t.mu.Unlock()
	r := req.Clone(req.Context())
	r.URL.Host, r.Host = addr, addr
	return t.base.RoundTrip(r)
}

func newHTTPWorkload(ctx context.Context, b *cellBase) (*httpWorkload, func(), error) {
	addrs, err := freeAddrs(2)
	if err != nil {
		return nil, nil, err
	}
	base := &http.Transport{MaxIdleConnsPerHost: httpWorkers, IdleConnTimeout: 30 * time.Second, ResponseHeaderTimeout: 30 * time.Second}
	lb := &lbTransport{base: base, addrs: addrs, rng: rand.New(rand.NewPCG(b.env.Rand.Uint64(), b.env.Rand.Uint64()))}
	tr, err := httpidem.NewTransport(httpidem.TransportOptions{
		Base: lb, BareKey: true, MaxAttempts: 1000, MaxElapsed: 2 * time.Minute,
		Backoff: consumer.Backoff{Initial: 20 * time.Millisecond, Max: 500 * time.Millisecond},
	})
	if err != nil {
		return nil, nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	w := &httpWorkload{b: b, addrs: addrs, jobs: make(chan string, len(b.ids)), client: &http.Client{Transport: tr}, base: base, cancel: cancel}
	for range httpWorkers {
		w.wg.Add(1)
		go w.work(ctx)
	}
	return w, func() {
		cancel()
		w.wg.Wait()
		base.CloseIdleConnections()
	}, nil
}

func (w *httpWorkload) fail(err error) {
	w.mu.Lock()
	if w.err == nil {
		w.err = err
	}
	w.mu.Unlock()
}

func (w *httpWorkload) failed() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

// work sends the requests of the ids it takes, each until its 201.
func (w *httpWorkload) work(ctx context.Context) {
	defer w.wg.Done()
	for {
		var id string
		select {
		case <-ctx.Done():
			return
		case id = <-w.jobs:
		}
		deadline := time.Now().Add(3 * time.Minute)
		kctx := httpidem.WithKey(ctx, id)
		for {
			req, err := http.NewRequestWithContext(kctx, http.MethodPost, "http://chaos/charge", strings.NewReader(id))
			if err != nil {
				w.fail(err)
				return
			}
			resp, err := w.client.Do(req)
			if err == nil {
				body, rerr := io.ReadAll(resp.Body)
				_ = resp.Body.Close()
				switch {
				case rerr == nil && resp.StatusCode == http.StatusCreated && string(body) == id:
					w.acked.Add(1)
				case resp.StatusCode == http.StatusCreated:
					w.fail(fmt.Errorf("request %s: 201 with body %q", id, body))
				case resp.StatusCode >= 400 && resp.StatusCode < 500 && resp.StatusCode != http.StatusConflict && resp.StatusCode != http.StatusTooManyRequests:
					w.fail(fmt.Errorf("request %s: %s: %s", id, resp.Status, body))
				default:
					err = fmt.Errorf("%s", resp.Status)
				}
				if err == nil {
					break
				}
			}
			if ctx.Err() != nil {
				return
			}
			if time.Now().After(deadline) {
				w.fail(fmt.Errorf("request %s: no 201 after 3 minutes of retries: %w", id, err))
				break
			}
			if sleepCtx(ctx, 50*time.Millisecond) != nil {
				return
			}
		}
	}
}

func (w *httpWorkload) child() string { return "http-server" }

func (w *httpWorkload) config(slot int) childConfig {
	c := w.b.config()
	c.Addr = w.addrs[slot]
	return c
}

func (w *httpWorkload) produce(_ context.Context, ids []string) error {
	for _, id := range ids {
		w.jobs <- id // buffered for every id
	}
	return nil
}

func (w *httpWorkload) progress(context.Context) (int, error) {
	return int(w.acked.Load()), w.failed()
}

func (w *httpWorkload) drained(context.Context, time.Duration) (bool, error) {
	return int(w.acked.Load()) == len(w.b.ids), w.failed()
}

func (w *httpWorkload) settle(context.Context) error { return w.failed() }

// killWriter passes the after_commit point when the middleware starts a 2xx
// response: the claim and the effect are committed (or completed), the
// client has nothing yet.
type killWriter struct {
	http.ResponseWriter
	k     *killer
	wrote bool
}

func (w *killWriter) WriteHeader(code int) {
	if !w.wrote {
		w.wrote = true
		if code/100 == 2 {
			w.k.at(pointAfterCommit)
		}
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *killWriter) Write(p []byte) (int, error) {
	if !w.wrote {
		w.WriteHeader(http.StatusOK)
	}
	return w.ResponseWriter.Write(p)
}

// httpChild is the http-server child: POST /charge records the effect of
// the id in the body under the middleware.
func httpChild(ctx context.Context) error {
	r, err := newChildRun(ctx)
	if err != nil {
		return err
	}
	defer r.quit()
	cfg := r.cfg
	pool, err := childPool(r.ctx, cfg.PGURL, 6)
	if err != nil {
		return err
	}
	defer pool.Close()
	opts := httpidem.Options{RetryAfter: time.Second, Telemetry: consumer.Telemetry{Logger: childLogger()}}
	var mw *httpidem.Middleware
	switch cfg.Store {
	case storePG:
		store, err := pgtable.New(pool, pgtable.Options{Schema: cfg.Schema, Retention: 24 * time.Hour, Logger: childLogger()})
		if err != nil {
			return err
		}
		if mw, err = httpidem.NewTx(store, opts); err != nil {
			return err
		}
	case storeRedis:
		rdb := redis.NewClient(&redis.Options{Addr: cfg.RedisAddr, PoolSize: 8})
		defer func() { _ = rdb.Close() }()
		store, err := redisnx.New(rdb, redisnx.Options{Lease: cfg.lease(), Prefix: cfg.Prefix})
		if err != nil {
			return err
		}
		if mw, err = httpidem.New(store, opts); err != nil {
			return err
		}
	default:
		return fmt.Errorf("unknown store %q", cfg.Store)
	}
	ins := effectSQL(cfg.Effects)
	app := http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, err := io.ReadAll(req.Body)
		id := string(body)
		ctx := req.Context()
		if err == nil {
			if tx := httpidem.Tx[pgx.Tx](ctx); tx != nil {
				_, err = tx.Exec(ctx, ins, id, cfg.Name)
			} else {
				_, err = pool.Exec(ctx, ins, id, cfg.Name)
			}
		}
		if err != nil {
			httpidem.Release(ctx) // nothing happened: not stored, the retry runs again
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		r.kill.at(pointAfterEffect)
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, id)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /charge", mw.Handler(app))
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			if key, err := httpidem.ParseKey(req.Header.Get("Idempotency-Key"), 0); err == nil {
				r.log.record(key)
			}
			r.kill.at(pointBeforeTx)
			mux.ServeHTTP(&killWriter{ResponseWriter: w, k: r.kill}, req)
		}),
		ReadHeaderTimeout: 10 * time.Second,
	}
	var ln net.Listener
	for i := 0; ; i++ { // the address may still be held for a moment
		if ln, err = net.Listen("tcp", cfg.Addr); err == nil || i == 50 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		return err
	}
	r.ready()
	stopped := make(chan error, 1)
	go func() {
		<-r.ctx.Done()
		// The runner stops the servers once every request was answered,
		// so nothing is in flight: a connection the client opened and
		// never used (which Shutdown waits 5s for) is closed after 1s.
		sctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		err := srv.Shutdown(sctx)
		if errors.Is(err, context.DeadlineExceeded) {
			err = srv.Close()
		}
		stopped <- err
	}()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return r.done(err)
	}
	return <-stopped
}

// httpCell is an HTTP SIGKILL cell.
func httpCell(name, store string) Cell {
	return Cell{
		Name:             name,
		ExpectDuplicates: store == storeRedis,
		Run: func(ctx context.Context, env *Env) (Result, error) {
			n, kills := env.Pick(1000, 20000), env.Pick(8, 40)
			return withBase(ctx, env, name, store, n, func(b *cellBase) (Result, error) {
				w, cleanup, err := newHTTPWorkload(ctx, b)
				if err != nil {
					return Result{}, err
				}
				defer cleanup()
				return killCell(ctx, b, w, killSpec{
					kills: kills, workers: 2, points: consumerPoints,
					named: 8 * time.Second, limit: time.Duration(env.Pick(90, 600)) * time.Second,
				})
			})
		},
	}
}
