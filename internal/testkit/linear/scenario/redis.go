//go:build unix

package scenario

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/linear"
	"github.com/idemkit/idem/internal/testkit/rediscluster"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// startRedis starts a throwaway redis-server with args.
func startRedis(ctx context.Context, args ...string) (*fault.Redis, error) {
	srv, err := fault.StartRedis(ctx, fault.RedisOptions{Args: args})
	if err != nil && strings.Contains(err.Error(), "not found") {
		return nil, fmt.Errorf("%w: a throwaway redis-server: %w", ErrUnavailable, err)
	}
	return srv, err
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

// faultErr keeps the first error of a fault loop.
type faultErr struct {
	mu  sync.Mutex
	err error
}

func (f *faultErr) set(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err == nil {
		f.err = err
	}
}

func (f *faultErr) get() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.err
}

// RedisnxKilled runs clients on redisnx, with go-redis's default retries, on a
// Redis that fsyncs every write before answering (appendonly yes,
// appendfsync always) and is SIGKILLed and restarted every 300ms. Calls cut
// by a kill are Unknown outcomes. Checked under LeaseModel: a restart
// loses no acknowledged lease or done mark, and no call is run twice.
// Defaults: 8 clients, 3 keys, 40 operations each.
func RedisnxKilled(ctx context.Context, size Size) (*Outcome, error) {
	const lease, ttl = 500 * time.Millisecond, 500 * time.Millisecond
	srv, err := startRedis(ctx, "--appendonly", "yes", "--appendfsync", "always")
	if err != nil {
		return nil, err
	}
	defer func() { _ = srv.Close() }()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer func() { _ = c.Close() }()
	s, err := redisnx.New(c, redisnx.Options{Lease: lease, TTL: ttl})
	if err != nil {
		return nil, err
	}
	kills := 0
	var ferr faultErr
	w := linear.Workload{Scope: testenv.UniqueID("rkill"), Lease: lease, TTL: ttl, Ops: 40}
	size.apply(&w)
	h := linear.RunLease(ctx, linear.Target{Store: s, Read: redisRead(c, s)}, w, func(fctx context.Context) {
		every(fctx, 300*time.Millisecond, func() bool {
			_ = srv.Kill()
			kills++
			if err := srv.Restart(ctx); err != nil {
				ferr.set(fmt.Errorf("restart: %w", err))
				return false
			}
			return true
		})
	})
	if err := ferr.get(); err != nil {
		return nil, err
	}
	return &Outcome{Name: "redisnx killed", Model: linear.LeaseModel(lease, ttl, Slack), History: h,
		Faults: kills, Restarts: kills,
		Note: fmt.Sprintf("Redis (appendfsync always) SIGKILLed and restarted %d times", kills)}, nil
}

// RedisnxCluster runs clients on redisnx on a three-master Redis Cluster
// (one replica each, cluster-node-timeout 1s), while every 500ms a fault
// hits one master, the shards in turn, alternating two kinds:
//
//   - a freeze: the master is stopped (SIGSTOP) for 300ms, shorter than
//     the node timeout, so no replica takes over; calls to it time out
//     as Unknown outcomes and may still run when it wakes;
//   - a failover (rediscluster.FailOver): the master's writes are paused
//     until its replica has every write it acknowledged, it is SIGKILLed,
//     the replica takes over, and the killed node comes back empty as the
//     new master's replica.
//
// Checked under LeaseModel. A failover to a replica that had not received
// a write is kept out: Redis replicates asynchronously, and such a
// failover loses the write, which the model counts as a violation.
// Defaults: 8 clients, 6 keys, 40 operations each.
func RedisnxCluster(ctx context.Context, size Size) (*Outcome, error) {
	const lease, ttl = 600 * time.Millisecond, 600 * time.Millisecond
	cl, err := rediscluster.New(ctx, rediscluster.Options{})
	if err != nil {
		if strings.Contains(err.Error(), "executable file not found") {
			err = fmt.Errorf("%w: %w", ErrUnavailable, err)
		}
		return nil, err
	}
	defer func() { _ = cl.Close() }()
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs()})
	defer func() { _ = c.Close() }()
	s, err := redisnx.New(c, redisnx.Options{Lease: lease, TTL: ttl, FailoverWait: -1})
	if err != nil {
		return nil, err
	}
	pauses, failovers := 0, 0
	var took []time.Duration // each FailOver, from the pause of writes to the rejoined replica
	var ferr faultErr
	w := linear.Workload{Scope: testenv.UniqueID("rcl"), Keys: 6, Lease: lease, TTL: ttl, Ops: 40, CallTimeout: 200 * time.Millisecond}
	size.apply(&w)
	h := linear.RunLease(ctx, linear.Target{Store: s, Read: redisRead(c, s)}, w, func(fctx context.Context) {
		n := 0
		every(fctx, 500*time.Millisecond, func() bool {
			shards, err := cl.Shards(ctx)
			if err != nil {
				ferr.set(err)
				return false
			}
			m := shards[(n/2)%len(shards)].Master
			if n%2 == 0 {
				if err := cl.Pause(ctx, m); err != nil {
					ferr.set(fmt.Errorf("pause %s: %w", m, err))
					return false
				}
				time.Sleep(300 * time.Millisecond)
				if err := cl.Resume(ctx, m); err != nil {
					ferr.set(fmt.Errorf("resume %s: %w", m, err))
					return false
				}
				pauses++
			} else {
				start := time.Now()
				if _, err := cl.FailOver(ctx, m); err != nil {
					ferr.set(fmt.Errorf("fail %s over: %w", m, err))
					return false
				}
				took = append(took, time.Since(start))
				failovers++
			}
			n++
			return true
		})
	})
	if err := ferr.get(); err != nil {
		return nil, err
	}
	return &Outcome{Name: "redisnx cluster", Model: linear.LeaseModel(lease, ttl, Slack), History: h,
		Faults: pauses + failovers, Restarts: failovers,
		Note: fmt.Sprintf("%d masters frozen for 300ms, %d failed over (paused, in sync, SIGKILLed, replaced%s)", pauses, failovers, meanMax(took))}, nil
}

// every runs f every d until ctx ends or f returns false.
func every(ctx context.Context, d time.Duration, f func() bool) {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if !f() {
				return
			}
		}
	}
}

// meanMax describes durations as ", each in 3.1s mean, 4.2s max", or ""
// without any.
func meanMax(ds []time.Duration) string {
	if len(ds) == 0 {
		return ""
	}
	var sum, top time.Duration
	for _, d := range ds {
		sum += d
		top = max(top, d)
	}
	mean := sum / time.Duration(len(ds))
	return fmt.Sprintf(", each in %v mean, %v max", mean.Round(100*time.Millisecond), top.Round(100*time.Millisecond))
}
