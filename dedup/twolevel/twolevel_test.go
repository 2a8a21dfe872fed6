package twolevel_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/dedup/twolevel"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, testenv.LeakOptions()...) }

type fixture struct {
	store  *twolevel.Store[pgx.Tx]
	db     *pgtable.Store
	rdb    *redis.Client
	prefix string
	mp     *telemetrytest.Metrics
}

// count is the idem.twolevel.answers count of source.
func (f *fixture) count(source string) int {
	return answers(f.mp, source)
}

// stats lists every idem.twolevel.answers count, for failure messages.
func (f *fixture) stats() map[string]int {
	out := map[string]int{}
	for _, p := range f.mp.Points(telemetry.MetricTwoLevelAnswers) {
		v, _ := p.Attrs.Value(telemetry.AttrSource)
		out[v.AsString()] += int(p.Value)
	}
	return out
}

func answers(mp *telemetrytest.Metrics, source string) int {
	return int(mp.Sum(telemetry.MetricTwoLevelAnswers, telemetry.AttrSource.String(source)))
}

func newFixture(t testing.TB, pool *pgxpool.Pool, rdb *redis.Client) *fixture {
	t.Helper()
	f := &fixture{rdb: rdb, prefix: testenv.Name("idem2l"), mp: telemetrytest.NewMetrics(t)}
	db, err := pgtable.New(pool, pgtable.Options{Schema: testenv.Schema(t, pool)})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	cache, err := redisnx.New(rdb, redisnx.Options{Prefix: f.prefix})
	if err != nil {
		t.Fatal(err)
	}
	f.db = db
	// No test on this fixture is about the cache timeout: a generous one
	// keeps a Redis call slowed down by a loaded machine from handing the
	// answer to the database, which the exact answer counts would see.
	f.store, err = twolevel.New(cache, db, twolevel.Options{CacheTimeout: 10 * time.Second, MeterProvider: f.mp})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { flushPrefix(t, rdb, f.prefix) })
	return f
}

// flushPrefix deletes every cache key of the fixture: what a Redis restart
// without persistence does.
func flushPrefix(t testing.TB, rdb *redis.Client, prefix string) {
	ctx := context.Background()
	iter := rdb.Scan(ctx, 0, prefix+":*", 1000).Iterator()
	for iter.Next(ctx) {
		if err := rdb.Del(ctx, iter.Val()).Err(); err != nil {
			t.Errorf("flush: %v", err)
		}
	}
	if err := iter.Err(); err != nil {
		t.Errorf("flush: %v", err)
	}
}

var registry sync.Map // *twolevel.Store[pgx.Tx] -> *fixture

func TestConformance(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 20)
	rdb := testenv.Redis(t)
	deduptest.RunTx(t, deduptest.TxHarness[pgx.Tx]{
		New: func(t testing.TB) dedup.TxStore[pgx.Tx] {
			f := newFixture(t, pool, rdb)
			registry.Store(f.store, f)
			return f.store
		},
		Down: func(t testing.TB) dedup.TxStore[pgx.Tx] {
			// Both levels down: the cache fails, the database fails,
			// and the answer is an error.
			deadRedis := redis.NewClient(&redis.Options{Addr: testenv.DeadAddr(t), MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
			t.Cleanup(func() { _ = deadRedis.Close() })
			cache, err := redisnx.New(deadRedis, redisnx.Options{})
			if err != nil {
				t.Fatal(err)
			}
			cfg, _ := pgxpool.ParseConfig("postgres://postgres@" + testenv.DeadAddr(t) + "/test?connect_timeout=2")
			deadPool, err := pgxpool.NewWithConfig(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(deadPool.Close)
			db, err := pgtable.New(deadPool, pgtable.Options{})
			if err != nil {
				t.Fatal(err)
			}
			s, err := twolevel.New(cache, db, twolevel.Options{})
			if err != nil {
				t.Fatal(err)
			}
			return s
		},
		Expire: func(t testing.TB, s dedup.TxStore[pgx.Tx]) {
			v, _ := registry.Load(s)
			f := v.(*fixture)
			flushPrefix(t, rdb, f.prefix)
			if _, err := pool.Exec(context.Background(), "UPDATE "+f.db.Table()+" SET expires_at = clock_timestamp() - interval '1 second'"); err != nil {
				t.Fatal(err)
			}
			if _, err := f.db.Cleanup(context.Background()); err != nil {
				t.Fatal(err)
			}
		},
	})
}

// TestHotDuplicatesSkipTheDatabase: once a key is done, duplicates are
// answered by the cache.
func TestHotDuplicatesSkipTheDatabase(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testenv.Pool(t, 8), testenv.Redis(t))
	ctx := testenv.Ctx(t)
	key := dedup.NewKey("pay", testenv.UniqueID("p"), []byte("100"))
	noop := func(context.Context, pgx.Tx) ([]byte, error) { return []byte("ok"), nil }
	if _, err := f.store.Process(ctx, key, noop); err != nil {
		t.Fatal(err)
	}
	for range 50 {
		_, err := f.store.Process(ctx, key, noop)
		if res, ok := dedup.StoredResult(err); !ok || string(res) != "ok" {
			t.Fatalf("duplicate = %v (%q)", err, res)
		}
	}
	if f.count(telemetry.SourceCacheDuplicate) != 50 || f.count(telemetry.SourceDatabaseDuplicate) != 0 {
		t.Fatalf("answers %v: want 50 cache duplicates and no database duplicate", f.stats())
	}
}

// TestLostCacheCostsOnlyARoundTrip: the cache forgets everything (a Redis
// restart without persistence) between deliveries; the database still
// catches every duplicate, and the mark is written back.
func TestLostCacheCostsOnlyARoundTrip(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 8)
	f := newFixture(t, pool, testenv.Redis(t))
	ctx := testenv.Ctx(t)
	var effects atomic.Int64
	fn := func(context.Context, pgx.Tx) ([]byte, error) { effects.Add(1); return []byte("r"), nil }
	const n = 100
	keys := make([]dedup.Key, n)
	for i := range keys {
		keys[i] = dedup.NewKey("pay", testenv.UniqueID("p"), []byte("x"))
		if _, err := f.store.Process(ctx, keys[i], fn); err != nil {
			t.Fatal(err)
		}
	}
	flushPrefix(t, f.rdb, f.prefix)
	for _, k := range keys {
		if _, err := f.store.Process(ctx, k, fn); !errors.Is(err, dedup.ErrDuplicate) {
			t.Fatalf("redelivery after the cache was lost = %v, want ErrDuplicate", err)
		}
	}
	if got := effects.Load(); got != n {
		t.Fatalf("%d effects for %d keys", got, n)
	}
	if f.count(telemetry.SourceDatabaseDuplicate) != n {
		t.Fatalf("answers %v: want %d duplicates answered by the database", f.stats(), n)
	}
	// The marks were written back: the next round is answered by the cache.
	for _, k := range keys {
		if _, err := f.store.Process(ctx, k, fn); !errors.Is(err, dedup.ErrDuplicate) {
			t.Fatal(err)
		}
	}
	if f.count(telemetry.SourceCacheDuplicate) != n {
		t.Fatalf("answers %v: want %d cache duplicates after write-back", f.stats(), n)
	}
}

// TestCacheDownDatabaseDecides: with the cache unreachable, Process still
// dedups through the database, under concurrency.
func TestCacheDownDatabaseDecides(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 20)
	dead := redis.NewClient(&redis.Options{Addr: testenv.DeadAddr(t), MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	defer dead.Close()
	cache, err := redisnx.New(dead, redisnx.Options{})
	if err != nil {
		t.Fatal(err)
	}
	db, err := pgtable.New(pool, pgtable.Options{Schema: testenv.Schema(t, pool)})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	mp := telemetrytest.NewMetrics(t)
	s, err := twolevel.New(cache, db, twolevel.Options{MeterProvider: mp})
	if err != nil {
		t.Fatal(err)
	}
	ctx := testenv.Ctx(t)
	key := dedup.NewKey("pay", testenv.UniqueID("p"), []byte("x"))
	var effects atomic.Int64
	var wg sync.WaitGroup
	for range 30 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := s.Process(ctx, key, func(context.Context, pgx.Tx) ([]byte, error) {
				effects.Add(1)
				return nil, nil
			})
			if err != nil && !errors.Is(err, dedup.ErrDuplicate) {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if effects.Load() != 1 {
		t.Fatalf("%d effects with the cache down, want 1", effects.Load())
	}
	if n := answers(mp, telemetry.SourceCacheUnavailable); n != 30 {
		t.Fatalf("cache unavailable counted %d times, want 30", n)
	}
}

func TestNewErrors(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 2)
	db, _ := pgtable.New(pool, pgtable.Options{})
	if _, err := twolevel.New(nil, db, twolevel.Options{}); err == nil {
		t.Error("nil cache accepted")
	}
	rdb := testenv.Redis(t)
	cache, _ := redisnx.New(rdb, redisnx.Options{})
	if _, err := twolevel.New[pgx.Tx](cache, nil, twolevel.Options{}); err == nil {
		t.Error("nil db accepted")
	}
	if _, err := twolevel.New(cache, db, twolevel.Options{CacheTimeout: -1}); err == nil {
		t.Error("negative CacheTimeout accepted")
	}
	if _, err := twolevel.New(cache, db, twolevel.Options{MaxKeyLen: -1}); err == nil {
		t.Error("negative MaxKeyLen accepted")
	}
}

// TestFailedCompleteDoesNotHideTheCommit: the cache becomes unreachable
// between the database commit and the cache's Complete, so the cache keeps a
// live lease for a key whose payment committed. The next duplicate, with
// the cache reachable again and the lease still live, is answered from the
// committed row (a duplicate with the receipt), not "in flight"; a key
// whose transaction is really running is still in flight.
func TestFailedCompleteDoesNotHideTheCommit(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 8)
	direct := testenv.Redis(t)
	px, err := fault.NewProxy(testenv.RedisAddr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = px.Close() })
	rdb := redis.NewClient(&redis.Options{Addr: px.Addr(), MaxRetries: -1, DialerRetries: 1})
	t.Cleanup(func() { _ = rdb.Close() })
	f := newFixture(t, pool, rdb)
	t.Cleanup(func() { flushPrefix(t, direct, f.prefix) }) // the proxied client is closed by then
	schema := testenv.Schema(t, pool)
	charges := testenv.NewCharges(t, pool, schema)
	ctx := testenv.Ctx(t)

	pay := func(id string, then func()) dedup.TxFunc[pgx.Tx] {
		return func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			receipt := testenv.Receipt()
			if _, err := tx.Exec(ctx, charges.Insert(), id, receipt, 100); err != nil {
				return nil, err
			}
			then()
			return []byte(receipt), nil
		}
	}
	seen := map[string][]string{}
	key := dedup.NewKey("pay", testenv.UniqueID("p"), []byte("100"))
	// The cache is cut off once the charge is written: the commit goes
	// through, the Complete that follows it fails.
	res, err := f.store.Process(ctx, key, pay("pay-1", func() { px.SetMode(fault.Reset, 0) }))
	if err != nil {
		t.Fatalf("first payment: %v", err)
	}
	seen["pay-1"] = append(seen["pay-1"], string(res))
	px.SetMode(fault.Pass, 0)

	// The lease the failed Complete left behind is live.
	probe, err := redisnx.New(direct, redisnx.Options{Prefix: f.prefix})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := probe.Claim(ctx, key); !errors.Is(err, dedup.ErrInFlight) {
		t.Fatalf("cache claim after the failed Complete = %v; want the live lease (ErrInFlight)", err)
	}

	for i := range 3 {
		_, err := f.store.Process(ctx, key, pay("pay-1", func() {}))
		stored, ok := dedup.StoredResult(err)
		if !ok {
			t.Fatalf("duplicate %d after a failed Complete = %v; want ErrDuplicate with the committed receipt (answers %v)", i, err, f.stats())
		}
		seen["pay-1"] = append(seen["pay-1"], string(stored))
	}
	if n := f.count(telemetry.SourceDatabaseDuplicate); n != 3 {
		t.Fatalf("answers %v: want 3 duplicates answered from the database", f.stats())
	}

	// A payment whose transaction is open is in flight, and the read of
	// its row does not wait for it.
	key2 := dedup.NewKey("pay", testenv.UniqueID("p"), []byte("100"))
	entered, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		res, err := f.store.Process(ctx, key2, pay("pay-2", func() { close(entered); <-release }))
		if err == nil {
			seen["pay-2"] = append(seen["pay-2"], string(res))
		}
		done <- err
	}()
	<-entered
	_, err = f.store.Process(ctx, key2, pay("pay-2", func() {}))
	close(release)
	if werr := <-done; werr != nil {
		t.Fatalf("second payment: %v", werr)
	}
	if !errors.Is(err, dedup.ErrInFlight) {
		t.Fatalf("duplicate of a payment in progress = %v; want ErrInFlight", err)
	}
	if n := f.count(telemetry.SourceCacheInFlight); n != 1 {
		t.Fatalf("answers %v: want 1 in-flight answer", f.stats())
	}
	charges.Check(t, []string{"pay-1", "pay-2"}, seen)
}

// TestInFlightUncheckedIsAnError: the cache holds the key's lease and the
// database cannot be read, so whether the lease's holder committed is
// unknown: Process answers the database's error, neither "in flight" nor a
// run of fn.
func TestInFlightUncheckedIsAnError(t *testing.T) {
	t.Parallel()
	rdb := testenv.Redis(t)
	prefix := testenv.Name("idem2l")
	t.Cleanup(func() { flushPrefix(t, rdb, prefix) })
	cache, err := redisnx.New(rdb, redisnx.Options{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig("postgres://postgres@" + testenv.DeadAddr(t) + "/test?connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	deadPool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(deadPool.Close)
	db, err := pgtable.New(deadPool, pgtable.Options{})
	if err != nil {
		t.Fatal(err)
	}
	mp := telemetrytest.NewMetrics(t)
	s, err := twolevel.New(cache, db, twolevel.Options{CacheTimeout: 10 * time.Second, MeterProvider: mp})
	if err != nil {
		t.Fatal(err)
	}
	ctx := testenv.Ctx(t)
	key := dedup.NewKey("pay", testenv.UniqueID("p"), []byte("x"))
	if _, err := cache.Claim(ctx, key); err != nil { // the lease of a holder whose outcome is unknown
		t.Fatal(err)
	}
	ran := false
	_, err = s.Process(ctx, key, func(context.Context, pgx.Tx) ([]byte, error) { ran = true; return nil, nil })
	if err == nil || errors.Is(err, dedup.ErrInFlight) || errors.Is(err, dedup.ErrDuplicate) || ran {
		t.Fatalf("Process with a cache lease and the database down = %v (fn ran: %v); want the database's error", err, ran)
	}
	if n := answers(mp, telemetry.SourceDatabaseOther); n != 1 {
		t.Fatalf("db_other counted %d times, want 1", n)
	}
}
