//go:build unix

package chaos

// redis/cluster/master-kill: consumer.Dedup on dedup/redisnx over a
// throwaway Redis Cluster (internal/testkit/rediscluster: three masters, one
// replica each, cluster-node-timeout 1s), the effect written to the oracle on
// the shared PostgreSQL, while the masters of the shards are SIGKILLed one
// after another and their replicas take over. The broker delivers some
// acknowledged messages again up to 2s later, across the failovers.
//
// Promise: 0 duplicate effects, 0 lost, and every acknowledged message's
// mark still there at the end (a claim of it answers ErrDuplicate).
//
// What the cell checks is the lease store across a failover: a claim on a
// shard without a master fails (never a false "absent"), the Store reloads
// the slot map and reaches the promoted replica, and no lease or completed
// mark the dead master had acknowledged is lost with it. Redis replicates
// asynchronously, so a write acknowledged in the last moment before a
// master dies may be missing on its replica; that is Redis's window, not
// the Store's, and the cell keeps it out: each kill waits until no message
// is being handled (a gate the consumers hold for reading around each
// message), then until the victim's replica has the master's replication
// offset, and only then SIGKILLs the master. Messages arriving meanwhile
// wait at the gate; those whose claim meets the dead shard fail and are
// redelivered. With the effect outside the lease (an autocommit INSERT),
// a consumer crash between the effect and Complete would still repeat the
// effect once the lease ran out (the lease guarantee); the consumers of
// this cell do not crash, the Redis masters do.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/rediscluster"
)

func init() {
	Register(Cell{Name: "redis/cluster/master-kill", Run: srvRedisClusterKill})
}

// srvGate lets the consumers through, one message each, except while a
// kill is being prepared.
type srvGate struct{ mu sync.RWMutex }

func (g *srvGate) middleware(next consumer.Handler) consumer.Handler {
	return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		g.mu.RLock()
		defer g.mu.RUnlock()
		return next.Handle(ctx, m)
	})
}

// srvClusterKills SIGKILLs the master of shard 0, then 1, ... (kills in
// all), each once its replica has every acknowledged write, and waits for
// the promotion. failovers gets the time from each kill to the promotion
// seen by a live node.
func srvClusterKills(c *rediscluster.Cluster, gate *srvGate, kills int, r *rand.Rand, res *Result, failovers *[]time.Duration, env *Env) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		shards, err := c.Shards(ctx)
		if err != nil {
			return err
		}
		for i := range min(kills, len(shards)) {
			if !srvSleep(ctx, srvBetween(r, 500*time.Millisecond, 1500*time.Millisecond)) {
				return nil
			}
			dead := shards[i].Master
			gate.mu.Lock()
			sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			err := c.WaitInSync(sctx, dead)
			cancel()
			if err == nil {
				err = c.Kill(dead)
			}
			gate.mu.Unlock()
			if err != nil {
				return fmt.Errorf("kill %d (%s): %w", i+1, dead, err)
			}
			killed := time.Now()
			res.Kills++
			wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			promoted, err := c.WaitMaster(wctx, int(shards[i].Slots[0].Start), dead)
			cancel()
			if err != nil {
				return fmt.Errorf("kill %d (%s): %w", i+1, dead, err)
			}
			*failovers = append(*failovers, time.Since(killed))
			env.Logf("master %s killed, %s took over after %v", dead, promoted, time.Since(killed).Round(time.Millisecond))
		}
		srvSleep(ctx, time.Second) // the promoted masters serve a while
		return nil
	}
}

func srvRedisClusterKill(ctx context.Context, env *Env) (res Result, err error) {
	const name = "redis/cluster/master-kill"
	n := env.Pick(1500, 6000)
	kills := env.Pick(2, 3)
	c, err := rediscluster.New(ctx, rediscluster.Options{})
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, c.Close()) }()
	client := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs: c.Addrs(), PoolSize: 8,
		DialTimeout: 500 * time.Millisecond, ReadTimeout: time.Second, WriteTimeout: time.Second,
	})
	defer func() { err = errors.Join(err, client.Close()) }()
	shared, err := srvPool(ctx, env.PGURL, 4)
	if err != nil {
		return res, err
	}
	defer shared.Close()
	o, err := NewOracle(ctx, shared, name, env.Seed)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, o.Drop(context.WithoutCancel(ctx))) }()

	store, err := redisnx.New(client, redisnx.Options{Lease: 2 * time.Second, TTL: time.Hour, Prefix: "chaos"})
	if err != nil {
		return res, err
	}
	scope := "chaos/" + name
	var outcomes srvCounts
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: scope, Telemetry: consumer.Telemetry{OnOutcome: outcomes.outcome}, FinishTimeout: 3 * time.Second})
	if err != nil {
		return res, err
	}
	gate := &srvGate{}
	h := srvChain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return o.Record(ctx, shared, m.ID, "consumer")
	}), gate.middleware, dd)
	q := newSrvQueue(srvRand(env), 0.3, 2*time.Second)
	var failovers []time.Duration
	plan := time.Duration(kills) * 3 * time.Second
	rep, runErr := srvRun(ctx, env, q, srvIDs(n), plan, 8, h, srvClusterKills(c, gate, kills, srvRand(env), &res, &failovers, env))
	res.Messages, res.Redeliveries = rep.released, rep.redeliveries
	if err := srvCheck(ctx, o, rep.acked, &res); err != nil {
		return res, errors.Join(runErr, err)
	}
	marksLost, err := srvMarksLost(ctx, store, scope, rep.acked)
	if err != nil {
		return res, errors.Join(runErr, err)
	}
	took := make([]string, len(failovers))
	for i, d := range failovers {
		took[i] = d.Round(100 * time.Millisecond).String()
	}
	res.Note = fmt.Sprintf("%d masters killed once their replica had caught up, failovers in %s; %d of %d acknowledged marks lost; %s",
		res.Kills, strings.Join(took, ", "), marksLost, len(rep.acked), outcomes.String())
	if marksLost > 0 {
		runErr = errors.Join(runErr, fmt.Errorf("%d acknowledged messages' marks are gone after the failovers", marksLost))
	}
	return res, runErr
}

// srvMarksLost claims every acknowledged message again and counts those
// that are not answered as duplicates: marks the failovers lost.
func srvMarksLost(ctx context.Context, store *redisnx.Store, scope string, acked []string) (lost int, err error) {
	for start := 0; start < len(acked); start += 500 {
		ids := acked[start:min(start+500, len(acked))]
		keys := make([]dedup.Key, len(ids))
		for i, id := range ids {
			keys[i] = dedup.NewKey(scope, id, srvPayload(id))
		}
		var res []dedup.BatchResult
		err := srvRetry(ctx, 30*time.Second, func(ctx context.Context) error {
			var err error
			res, err = store.ClaimBatch(ctx, keys)
			return err
		})
		if err != nil {
			return lost, fmt.Errorf("claim the acknowledged messages again: %w", err)
		}
		for _, r := range res {
			if !errors.Is(r.Err, dedup.ErrDuplicate) {
				lost++
			}
		}
	}
	return lost, nil
}
