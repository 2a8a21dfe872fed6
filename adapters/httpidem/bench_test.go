package httpidem_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// benchClients is the number of concurrent HTTP clients.
const benchClients = 16

// benchVariant is one server setup: a handler stack, and whether its
// requests replay one completed key or each use a new key.
type benchVariant struct {
	name   string
	h      http.Handler
	replay bool
}

// benchVariants builds the handlers compared by the benchmarks:
//
//   - bare: the payment handler without the middleware (decode the JSON
//     body, answer 201 with a JSON receipt);
//   - memstore, redisnx, pgtable_lease: the same handler behind the
//     middleware, for first requests (a new key each) and replays (one
//     completed key);
//   - own_tx: a handler that records the payment in its own transaction
//     (BEGIN, INSERT, COMMIT) without the middleware;
//   - pgtable_tx: the same handler behind the transactional middleware,
//     writing through httpidem.Tx, for first requests and replays.
func benchVariants(b *testing.B) []benchVariant {
	pool := testenv.Pool(b, 12)
	schema := testenv.Schema(b, pool)
	ctx := context.Background()
	table := pgx.Identifier{schema, "payments"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+table+" (id bigserial PRIMARY KEY, amount bigint NOT NULL, currency text NOT NULL, customer text NOT NULL)"); err != nil {
		b.Fatal(err)
	}
	insert := "INSERT INTO " + table + " (amount, currency, customer) VALUES ($1, $2, $3) RETURNING id"

	type payIn struct {
		Amount   int64  `json:"amount"`
		Currency string `json:"currency"`
		Customer string `json:"customer"`
	}
	var seq atomic.Int64
	answer := func(w http.ResponseWriter, id int64) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/payments/"+strconv.FormatInt(id, 10))
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(map[string]any{"id": id, "status": "succeeded"})
	}
	decode := func(w http.ResponseWriter, r *http.Request) (payIn, bool) {
		var in payIn
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, "bad request", http.StatusBadRequest)
			return in, false
		}
		return in, true
	}
	plain := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, ok := decode(w, r); ok {
			answer(w, seq.Add(1))
		}
	})
	ownTx := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, ok := decode(w, r)
		if !ok {
			return
		}
		var id int64
		err := pgx.BeginFunc(r.Context(), pool, func(tx pgx.Tx) error {
			return tx.QueryRow(r.Context(), insert, in.Amount, in.Currency, in.Customer).Scan(&id)
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		answer(w, id)
	})
	inTx := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		in, ok := decode(w, r)
		if !ok {
			return
		}
		var id int64
		if err := httpidem.Tx[pgx.Tx](r.Context()).QueryRow(r.Context(), insert, in.Amount, in.Currency, in.Customer).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		answer(w, id)
	})

	mem, err := memstore.New(memstore.Options{SweepInterval: -1})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = mem.Close() })
	rs, err := redisnx.New(testenv.Redis(b), redisnx.Options{Prefix: testenv.Name("httpbench")})
	if err != nil {
		b.Fatal(err)
	}
	pgs, err := pgtable.New(pool, pgtable.Options{Schema: schema, Retention: 24 * time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	if err := pgs.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	lease := func(s dedup.LeaseStore) http.Handler {
		m, err := httpidem.New(s, httpidem.Options{})
		if err != nil {
			b.Fatal(err)
		}
		return m.Handler(plain)
	}
	txMW, err := httpidem.NewTx(pgs, httpidem.Options{})
	if err != nil {
		b.Fatal(err)
	}
	return []benchVariant{
		{"bare", plain, false},
		{"memstore/first", lease(mem), false},
		{"memstore/replay", lease(mem), true},
		{"redisnx/first", lease(rs), false},
		{"redisnx/replay", lease(rs), true},
		{"pgtable_lease/first", lease(pgs.Lease()), false},
		{"pgtable_lease/replay", lease(pgs.Lease()), true},
		{"own_tx", ownTx, false},
		{"pgtable_tx/first", txMW.Handler(inTx), false},
		{"pgtable_tx/replay", txMW.Handler(inTx), true},
	}
}

const benchBody = `{"amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}`

var benchSeq atomic.Int64

// benchServer serves a variant over loopback; post sends one request.
type benchServer struct {
	srv    *httptest.Server
	tr     *http.Transport
	client *http.Client
	hot    string // the completed key replays use
	replay bool
}

func startBench(b *testing.B, v benchVariant) *benchServer {
	s := &benchServer{srv: httptest.NewServer(v.h), replay: v.replay}
	s.tr = &http.Transport{MaxIdleConns: 64, MaxIdleConnsPerHost: 64}
	s.client = &http.Client{Transport: s.tr}
	s.hot = testenv.Name("hot")
	if v.replay {
		if code, err := s.post(s.hot); code != http.StatusCreated {
			b.Fatalf("%s: completing the replayed key: %d %v", v.name, code, err)
		}
	}
	return s
}

func (s *benchServer) close() {
	s.tr.CloseIdleConnections()
	s.srv.Close()
}

func (s *benchServer) post(key string) (int, error) {
	req, _ := http.NewRequest(http.MethodPost, s.srv.URL+"/payments", strings.NewReader(benchBody))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := s.client.Do(req)
	if err != nil {
		return 0, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode, nil
}

func (s *benchServer) next() string {
	if s.replay {
		return s.hot
	}
	return "k-" + strconv.FormatInt(benchSeq.Add(1), 36)
}

// BenchmarkHTTP runs each variant (see benchVariants) as its own
// sub-benchmark: real HTTP requests over loopback from 16 concurrent
// clients, reporting req/s.
//
//	go test -run '^$' -bench 'HTTP$' -benchtime 3s ./adapters/httpidem/
//
// On a shared machine the load drifts between sub-benchmarks; for ratios
// use BenchmarkHTTPSideBySide.
func BenchmarkHTTP(b *testing.B) {
	for _, v := range benchVariants(b) {
		b.Run(v.name, func(b *testing.B) {
			s := startBench(b, v)
			defer s.close()
			b.SetParallelism(benchClients / 2)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if code, err := s.post(s.next()); code != http.StatusCreated {
						b.Errorf("status %d, %v", code, err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
		})
	}
}

// BenchmarkHTTPSideBySide interleaves the variants: each iteration is one
// round in which every variant serves 400 requests from 16 concurrent
// clients, so all of them see the same machine load. It reports each
// variant's rate (<variant>_req/s) over all rounds, and the two ratios the
// targets are about, computed per round and given as the median:
// redisnx_replay/bare and pgtable_tx_first/own_tx.
//
//	go test -run '^$' -bench SideBySide -benchtime 30x ./adapters/httpidem/
func BenchmarkHTTPSideBySide(b *testing.B) {
	const perRound = 400
	variants := benchVariants(b)
	servers := make([]*benchServer, len(variants))
	for i, v := range variants {
		servers[i] = startBench(b, v)
		b.Cleanup(servers[i].close)
	}
	elapsed := make([]time.Duration, len(variants))
	rate := func(d time.Duration) float64 { return perRound / d.Seconds() }
	index := map[string]int{}
	for i, v := range variants {
		index[v.name] = i
	}
	ratios := map[string][]float64{}
	ratio := func(name, num, den string, round []time.Duration) {
		ratios[name] = append(ratios[name], rate(round[index[num]])/rate(round[index[den]]))
	}
	b.ResetTimer()
	for range b.N {
		round := make([]time.Duration, len(variants))
		for i, s := range servers {
			var next atomic.Int64
			var wg sync.WaitGroup
			start := time.Now()
			for range benchClients {
				wg.Go(func() {
					for next.Add(1) <= perRound {
						if code, err := s.post(s.next()); code != http.StatusCreated {
							b.Errorf("%s: status %d, %v", variants[i].name, code, err)
							return
						}
					}
				})
			}
			wg.Wait()
			round[i] = time.Since(start)
			elapsed[i] += round[i]
		}
		ratio("redisnx_replay/bare", "redisnx/replay", "bare", round)
		ratio("pgtable_tx_first/own_tx", "pgtable_tx/first", "own_tx", round)
	}
	b.StopTimer()
	for i, v := range variants {
		b.ReportMetric(float64(b.N*perRound)/elapsed[i].Seconds(), strings.ReplaceAll(v.name, "/", "_")+"_req/s")
	}
	for name, rs := range ratios {
		sort.Float64s(rs)
		b.ReportMetric(rs[len(rs)/2], "median_"+name)
	}
	b.ReportMetric(0, "ns/op")
}

// BenchmarkServeHTTP is the middleware alone, without network: one op is
// one request served through ServeHTTP to a handler that decodes the JSON
// body and answers 201, on memstore. It isolates the middleware's CPU cost
// and allocations from the loopback HTTP that dominates BenchmarkHTTP:
// bare (no middleware), first (a new key each), replay (one completed key).
func BenchmarkServeHTTP(b *testing.B) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			Amount   int64  `json:"amount"`
			Currency string `json:"currency"`
			Customer string `json:"customer"`
		}
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":1,"status":"succeeded"}`))
	})
	mem, err := memstore.New(memstore.Options{SweepInterval: -1})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = mem.Close() })
	m, err := httpidem.New(mem, httpidem.Options{})
	if err != nil {
		b.Fatal(err)
	}
	wrapped := m.Handler(h)
	prefix := testenv.Name("direct") + "-"
	for _, v := range []struct {
		name string
		h    http.Handler
		key  func(i int) string
	}{
		{"bare", h, func(i int) string { return prefix + strconv.Itoa(i) }},
		{"memstore_first", wrapped, func(i int) string { return prefix + "f" + strconv.Itoa(i) }},
		{"memstore_replay", wrapped, func(int) string { return prefix + "hot" }},
	} {
		b.Run(v.name, func(b *testing.B) {
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				r := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(benchBody))
				r.Header.Set("Idempotency-Key", v.key(i))
				w := httptest.NewRecorder()
				v.h.ServeHTTP(w, r)
				if w.Code != http.StatusCreated {
					b.Fatalf("status %d", w.Code)
				}
			}
		})
	}
}

// BenchmarkServeHTTPStores is BenchmarkServeHTTP on the real stores, for
// profiling the middleware's paths the targets of BenchmarkHTTPSideBySide
// are about, without the loopback HTTP around them: redisnx_replay (one
// completed key, read from Redis every time), and pgtable_tx_first (a new
// key each, the handler inserting a payment through httpidem.Tx) beside
// own_tx (the same insert in the handler's own transaction). Requests come
// from 4 goroutines per CPU, so the store sees concurrent calls.
//
//	go test -run '^$' -bench ServeHTTPStores -cpuprofile cpu.out ./adapters/httpidem/
func BenchmarkServeHTTPStores(b *testing.B) {
	var named []benchVariant
	for _, v := range benchVariants(b) {
		switch v.name {
		case "bare", "redisnx/replay", "own_tx", "pgtable_tx/first":
			named = append(named, v)
		}
	}
	for _, v := range named {
		b.Run(strings.ReplaceAll(v.name, "/", "_"), func(b *testing.B) {
			hot := testenv.Name("hot")
			serve := func(key string) int {
				r := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(benchBody))
				r.Header.Set("Content-Type", "application/json")
				r.Header.Set("Idempotency-Key", key)
				w := httptest.NewRecorder()
				v.h.ServeHTTP(w, r)
				return w.Code
			}
			if v.replay {
				if code := serve(hot); code != http.StatusCreated {
					b.Fatalf("completing the replayed key: %d", code)
				}
			}
			b.ReportAllocs()
			b.SetParallelism(4)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					key := hot
					if !v.replay {
						key = "k-" + strconv.FormatInt(benchSeq.Add(1), 36)
					}
					if code := serve(key); code != http.StatusCreated {
						b.Errorf("status %d", code)
						return
					}
				}
			})
		})
	}
}
