//go:build unix

package linear_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/dedup/twolevel"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/linear"
	"github.com/idemkit/idem/internal/testkit/rediscluster"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// startRedis starts a throwaway redis-server with args.
func startRedis(t *testing.T, args ...string) *fault.Redis {
	t.Helper()
	srv, err := fault.StartRedis(context.Background(), fault.RedisOptions{Args: args})
	switch {
	case err != nil && strings.Contains(err.Error(), "not found"):
		testenv.Unavailable(t, fmt.Sprintf("a throwaway redis-server: %v", err))
	case err != nil:
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	return srv
}

// redisRead reads a key's record with a plain GET.
func redisRead(c redis.UniversalClient, s *redisnx.Store) func(context.Context, dedup.Key) (linear.State, error) {
	return func(ctx context.Context, k dedup.Key) (linear.State, error) {
		v, err := c.Get(ctx, s.RedisKey(k)).Result()
		switch {
		case errors.Is(err, redis.Nil):
			return linear.StateAbsent, nil
		case err != nil:
			return 0, err
		case v != "" && (v[0] == 'L' || v[0] == 'l'):
			return linear.StateHeld, nil
		}
		return linear.StateDone, nil
	}
}

// every runs f every d until ctx ends.
func every(ctx context.Context, d time.Duration, f func()) {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			f()
		}
	}
}

// TestRedisnxKilledLinearizable: eight clients on three keys of redisnx,
// with go-redis's default retries, on a Redis that fsyncs every write
// before answering (appendonly yes, appendfsync always) and is SIGKILLed
// and restarted every 300ms. Calls cut by a kill are Unknown outcomes. The
// history is linearizable under LeaseModel: a restart loses no
// acknowledged lease or done mark, and no call is run twice.
func TestRedisnxKilledLinearizable(t *testing.T) {
	const lease, ttl = 500 * time.Millisecond, 500 * time.Millisecond
	srv := startRedis(t, "--appendonly", "yes", "--appendfsync", "always")
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	s, err := redisnx.New(c, redisnx.Options{Lease: lease, TTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	ctx := testenv.Ctx(t)
	kills := 0
	w := linear.Workload{Scope: testenv.UniqueID("rkill"), Lease: lease, TTL: ttl, Ops: 40}
	h := linear.RunLease(ctx, linear.Target{Store: s, Read: redisRead(c, s)}, w, func(fctx context.Context) {
		every(fctx, 300*time.Millisecond, func() {
			_ = srv.Kill()
			if err := srv.Restart(ctx); err != nil {
				t.Errorf("restart: %v", err)
			}
			kills++
		})
	})
	t.Logf("%d kills", kills)
	linear.Check(t, "redisnx killed", linear.LeaseModel(lease, ttl, slack), h)
}

// TestRedisnxClusterLinearizable: eight clients on six keys of redisnx on
// a three-master Redis Cluster, while one master at a time is frozen
// (SIGSTOP) for 300ms, shorter than the cluster's node timeout, so no
// replica takes over: calls to the frozen master time out as Unknown
// outcomes. The history is linearizable under LeaseModel. A failover is
// not part of it: a replica promoted before it received a write loses it
// (Redis replicates asynchronously), which the model counts as a
// violation.
func TestRedisnxClusterLinearizable(t *testing.T) {
	const lease, ttl = 600 * time.Millisecond, 600 * time.Millisecond
	cl := rediscluster.Start(t, rediscluster.Options{NodeTimeout: 5 * time.Second})
	c := cl.Client(t, redis.ClusterOptions{})
	s, err := redisnx.New(c, redisnx.Options{Lease: lease, TTL: ttl, FailoverWait: -1})
	if err != nil {
		t.Fatal(err)
	}
	ctx := testenv.Ctx(t)
	shards, err := cl.Shards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pauses := 0
	w := linear.Workload{Scope: testenv.UniqueID("rcl"), Keys: 6, Lease: lease, TTL: ttl, Ops: 40, CallTimeout: 200 * time.Millisecond}
	h := linear.RunLease(ctx, linear.Target{Store: s, Read: redisRead(c, s)}, w, func(fctx context.Context) {
		every(fctx, 500*time.Millisecond, func() {
			m := shards[pauses%len(shards)].Master
			if err := cl.Pause(ctx, m); err != nil {
				t.Errorf("pause %s: %v", m, err)
				return
			}
			time.Sleep(300 * time.Millisecond)
			if err := cl.Resume(ctx, m); err != nil {
				t.Errorf("resume %s: %v", m, err)
			}
			pauses++
		})
	})
	t.Logf("%d pauses", pauses)
	linear.Check(t, "redisnx cluster", linear.LeaseModel(lease, ttl, slack), h)
}

// proxiedPool returns a pool to the test PostgreSQL through proxy.
func proxiedPool(t *testing.T, proxy *fault.Proxy) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	host, port, err := net.SplitHostPort(proxy.Addr())
	if err != nil {
		t.Fatal(err)
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = host, uint16(p)
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestPgtableLeaseLinearizable: eight clients on three keys of pgtable's
// lease mode, through a proxy that every 300ms spends 20ms cutting
// connections after forwarding a statement and before its reply reaches
// the client (the server ran it; the client cannot know). Reads are
// Store.Lookup. The history is linearizable under LeaseModel.
func TestPgtableLeaseLinearizable(t *testing.T) {
	const lease, ttl = 300 * time.Millisecond, 300 * time.Millisecond
	direct := testenv.Pool(t, 4)
	schema := testenv.Schema(t, direct)
	opts := pgtable.Options{Schema: schema, Lease: lease, Retention: ttl}
	mig, err := pgtable.New(direct, opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := mig.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	pgCfg, err := pgx.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	proxy, err := fault.NewProxy(net.JoinHostPort(pgCfg.Host, strconv.Itoa(int(pgCfg.Port))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = proxy.Close() })
	s, err := pgtable.New(proxiedPool(t, proxy), opts)
	if err != nil {
		t.Fatal(err)
	}
	read := func(ctx context.Context, k dedup.Key) (linear.State, error) {
		err := s.Lookup(ctx, k)
		switch {
		case err == nil:
			return linear.StateAbsent, nil
		case errors.Is(err, dedup.ErrInFlight):
			return linear.StateHeld, nil
		case errors.Is(err, dedup.ErrDuplicate):
			return linear.StateDone, nil
		}
		return 0, err
	}
	ctx := testenv.Ctx(t)
	// Eight keys keep each key's history short: a reply cut leaves its
	// operation unknown, and each unknown doubles what the check may try.
	w := linear.Workload{Scope: testenv.UniqueID("pg"), Lease: lease, TTL: ttl, Ops: 30, Keys: 8}
	h := linear.RunLease(ctx, linear.Target{Store: s.Lease(), Read: read}, w, func(fctx context.Context) {
		every(fctx, 300*time.Millisecond, func() {
			proxy.SetMode(fault.Cut, 0)
			time.Sleep(20 * time.Millisecond)
			proxy.SetMode(fault.Pass, 0)
		})
	})
	t.Logf("proxy: %+v", proxy.Stats())
	linear.Check(t, "pgtable lease", linear.LeaseModel(lease, ttl, slack), h)
}

// TestTwolevelLinearizable: eight clients process 40 keys through
// twolevel (redisnx in front of pgtable), while the cache, a Redis without
// persistence, is SIGKILLed and restarted empty every 100ms; one fn in
// eight fails. The history is linearizable under TxModel: each key's fn
// is committed at most once and every duplicate carries its result,
// whatever the cache forgot.
func TestTwolevelLinearizable(t *testing.T) {
	pool := testenv.Pool(t, 8)
	db, err := pgtable.New(pool, pgtable.Options{Schema: testenv.Schema(t, pool)})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	srv := startRedis(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	cache, err := redisnx.New(c, redisnx.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s, err := twolevel.New(cache, db, twolevel.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	process := func(ctx context.Context, k dedup.Key, value string, fnErr error) ([]byte, error) {
		return s.Process(ctx, k, func(context.Context, pgx.Tx) ([]byte, error) {
			if fnErr != nil {
				return nil, fnErr
			}
			return []byte(value), nil
		})
	}
	ctx := testenv.Ctx(t)
	kills := 0
	w := linear.Workload{Scope: testenv.UniqueID("2l"), Keys: 40, Ops: 100}
	h := linear.RunTx(ctx, process, w, func(fctx context.Context) {
		every(fctx, 100*time.Millisecond, func() {
			_ = srv.Kill()
			if err := srv.Restart(ctx); err != nil {
				t.Errorf("restart: %v", err)
			}
			kills++
		})
	})
	t.Logf("%d kills", kills)
	linear.Check(t, "twolevel", linear.TxModel(), h)
}
