//go:build unix

package chaos

// redis/ cells: a throwaway redis-server without persistence (internal/testkit/fault)
// SIGKILLed and restarted empty, and CLIENT KILL of its connections, while
// consumers dedup on it. The broker delivers some acknowledged messages again
// up to 2s later, across the restarts.
//
//   - redis/restart/redisnx: consumer.Dedup on dedup/redisnx alone, the
//     effect written to the oracle on the shared PostgreSQL. A restart
//     forgets every mark, so a redelivery after it runs the handler again:
//     duplicates are expected (Cell.ExpectDuplicates) and their rate is
//     reported. Lost must be 0: a message is acknowledged only after its
//     effect and its Complete.
//   - redis/restart/twolevel: dedup/twolevel, redisnx on the throwaway Redis
//     in front of dedup/pgtable on the shared PostgreSQL, the effect in the
//     claim's transaction. The database catches what the cache forgot.
//     Promise: 0 duplicate effects, 0 lost.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/dedup/twolevel"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/fault"
)

func init() {
	// go-redis logs every dial its pool retried against a server a fault
	// took down; the cell's line says what happened.
	redis.SetLogger(srvQuietRedis{})
	Register(Cell{Name: "redis/restart/redisnx", ExpectDuplicates: true, Run: srvRedisNX})
	Register(Cell{Name: "redis/restart/twolevel", Run: srvRedisTwoLevel})
}

// srvQuietRedis drops go-redis's own log lines.
type srvQuietRedis struct{}

func (srvQuietRedis) Printf(context.Context, string, ...any) {}

// srvRedisClient is the cells' go-redis client: small pool, short
// timeouts, go-redis's default retries.
func srvRedisClient(addr string) *redis.Client {
	return redis.NewClient(&redis.Options{
		Addr: addr, PoolSize: 8,
		DialTimeout: 500 * time.Millisecond, ReadTimeout: time.Second, WriteTimeout: time.Second,
	})
}

// srvRedisFaults kills and restarts rs (two rounds in three) or kills its
// client connections (CLIENT KILL), with random gaps.
func srvRedisFaults(rs *fault.Redis, rounds int, r *rand.Rand, res *Result, serverKills *int, env *Env) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		for i := range rounds {
			if !srvSleep(ctx, srvBetween(r, 300*time.Millisecond, 800*time.Millisecond)) {
				return nil
			}
			if r.IntN(3) < 2 {
				if err := rs.Kill(); err != nil {
					return err
				}
				res.Kills++
				*serverKills++
				srvSleep(ctx, srvBetween(r, 50*time.Millisecond, 300*time.Millisecond))
				if err := rs.Restart(context.WithoutCancel(ctx)); err != nil {
					return fmt.Errorf("round %d: %w", i+1, err)
				}
				res.Restarts++
				continue
			}
			n, err := rs.ClientKill(ctx)
			if err != nil {
				return fmt.Errorf("round %d: %w", i+1, err)
			}
			res.Kills += n
		}
		env.Logf("%d redis rounds done", rounds)
		return nil
	}
}

// srvRedisEnv is what a redis/ cell runs on: the throwaway Redis, a client
// on it, a pool on the shared PostgreSQL and the oracle there.
type srvRedisEnv struct {
	rs     *fault.Redis
	client *redis.Client
	shared *pgxpool.Pool
	o      *Oracle
}

func srvRedisSetup(ctx context.Context, env *Env, name string) (*srvRedisEnv, error) {
	rs, err := fault.StartRedis(ctx, fault.RedisOptions{})
	if err != nil {
		return nil, err
	}
	e := &srvRedisEnv{rs: rs, client: srvRedisClient(rs.Addr())}
	if e.shared, err = srvPool(ctx, env.PGURL, 4); err != nil {
		return nil, errors.Join(err, e.close(ctx))
	}
	if e.o, err = NewOracle(ctx, e.shared, name, env.Seed); err != nil {
		return nil, errors.Join(err, e.close(ctx))
	}
	return e, nil
}

func (e *srvRedisEnv) close(ctx context.Context) error {
	var err error
	if e.o != nil {
		err = e.o.Drop(context.WithoutCancel(ctx))
	}
	if e.shared != nil {
		e.shared.Close()
	}
	return errors.Join(err, e.client.Close(), e.rs.Close())
}

func srvRedisNX(ctx context.Context, env *Env) (res Result, err error) {
	const name = "redis/restart/redisnx"
	n := env.Pick(800, 5000)
	rounds := env.Pick(8, 40)
	e, err := srvRedisSetup(ctx, env, name)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, e.close(ctx)) }()
	rs, client, o := e.rs, e.client, e.o
	store, err := redisnx.New(client, redisnx.Options{Lease: 2 * time.Second, TTL: time.Hour, Prefix: "chaos"})
	if err != nil {
		return res, err
	}
	var outcomes srvCounts
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "chaos/" + name, Telemetry: consumer.Telemetry{OnOutcome: outcomes.outcome}, FinishTimeout: 3 * time.Second})
	if err != nil {
		return res, err
	}
	h := srvChain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return o.Record(ctx, e.shared, m.ID, "consumer")
	}), dd)
	q := newSrvQueue(srvRand(env), 0.3, 2*time.Second)
	var serverKills int
	plan := time.Duration(rounds) * 800 * time.Millisecond
	rep, runErr := srvRun(ctx, env, q, srvIDs(n), plan, 4, h, srvRedisFaults(rs, rounds, srvRand(env), &res, &serverKills, env))
	res.Messages, res.Redeliveries = rep.released, rep.redeliveries
	if err := srvCheck(ctx, o, rep.acked, &res); err != nil {
		return res, errors.Join(runErr, err)
	}
	res.Note = fmt.Sprintf("%d restarts without persistence forgot every mark; %s", serverKills, outcomes.String())
	return res, runErr
}

func srvRedisTwoLevel(ctx context.Context, env *Env) (res Result, err error) {
	const name = "redis/restart/twolevel"
	n := env.Pick(800, 5000)
	rounds := env.Pick(8, 40)
	e, err := srvRedisSetup(ctx, env, name)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, e.close(ctx)) }()
	rs, client, o := e.rs, e.client, e.o
	cache, err := redisnx.New(client, redisnx.Options{Lease: 2 * time.Second, TTL: time.Hour, Prefix: "chaos"})
	if err != nil {
		return res, err
	}
	db, err := srvMigratedStore(ctx, e.shared, o.Schema())
	if err != nil {
		return res, err
	}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	store, err := twolevel.New(cache, db, twolevel.Options{
		Logger: srvQuiet, CacheTimeout: 250 * time.Millisecond, MeterProvider: mp,
	})
	if err != nil {
		return res, err
	}
	h, err := consumer.Transactional(store, consumer.TxOptions{Scope: "chaos/" + name},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			return o.Record(ctx, tx, m.ID, "consumer")
		})
	if err != nil {
		return res, err
	}
	q := newSrvQueue(srvRand(env), 0.3, 2*time.Second)
	var serverKills int
	plan := time.Duration(rounds) * 800 * time.Millisecond
	rep, runErr := srvRun(ctx, env, q, srvIDs(n), plan, 4, srvChain(h), srvRedisFaults(rs, rounds, srvRand(env), &res, &serverKills, env))
	res.Messages, res.Redeliveries = rep.released, rep.redeliveries
	if err := srvCheck(ctx, o, rep.acked, &res); err != nil {
		return res, errors.Join(runErr, err)
	}
	sources, err := srvTwoLevelAnswers(context.WithoutCancel(ctx), reader)
	if err != nil {
		return res, errors.Join(runErr, err)
	}
	res.Note = fmt.Sprintf("%d restarts without persistence; answers by source: %s", serverKills, sources.String())
	return res, runErr
}

// srvTwoLevelAnswers reads the two-level store's idem.twolevel.answers
// counter from reader, by idem.source.
func srvTwoLevelAnswers(ctx context.Context, reader sdkmetric.Reader) (*srvCounts, error) {
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		return nil, fmt.Errorf("collect the two-level answers: %w", err)
	}
	var c srvCounts
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			sum, ok := m.Data.(metricdata.Sum[int64])
			if m.Name != telemetry.MetricTwoLevelAnswers || !ok {
				continue
			}
			for _, p := range sum.DataPoints {
				v, _ := p.Attributes.Value(telemetry.AttrSource)
				c.add(v.AsString(), int(p.Value))
			}
		}
	}
	return &c, nil
}
