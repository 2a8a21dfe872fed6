//go:build unix

package rediscluster_test

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/testkit/rediscluster"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, testenv.LeakOptions()...) }

// TestStart: three masters with one replica each, every slot covered, and
// a client that reaches every shard.
func TestStart(t *testing.T) {
	c := rediscluster.Start(t, rediscluster.Options{})
	ctx := t.Context()
	shards, err := c.Shards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(shards) != 3 {
		t.Fatalf("%d shards, want 3", len(shards))
	}
	covered := 0
	for _, s := range shards {
		if s.Master == "" || len(s.Replicas) != 1 {
			t.Fatalf("shard %+v, want one master and one replica", s)
		}
		for _, r := range s.Slots {
			covered += int(r.End - r.Start + 1)
		}
	}
	if covered != 16384 {
		t.Fatalf("%d slots covered, want 16384", covered)
	}
	cc := c.Client(t, redis.ClusterOptions{})
	for i := range 100 {
		if err := cc.Set(ctx, fmt.Sprintf("%s-%d", t.Name(), i), "v", 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := cc.ForEachMaster(ctx, func(ctx context.Context, n *redis.Client) error {
		return n.Ping(ctx).Err()
	}); err != nil {
		t.Fatal(err)
	}
}

// TestFailOver: keys written before each failover are all there after it,
// on the promoted replica, and the cluster is whole again (one master
// and one replica per shard) so the same shard fails over again.
func TestFailOver(t *testing.T) {
	c := rediscluster.Start(t, rediscluster.Options{})
	ctx := testenv.Ctx(t)
	cc := c.Client(t, redis.ClusterOptions{MaxRedirects: 16})
	// A writer keeps writing through every failover; a write the cluster
	// acknowledged must be there afterwards with its value. A write that
	// failed (its shard had no master for a moment) may be missing.
	var (
		mu    sync.Mutex
		acked = map[string]string{}
	)
	wctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := 0; wctx.Err() == nil; i++ {
			k, v := fmt.Sprintf("k%d", i), fmt.Sprintf("v%d", i)
			if err := cc.Set(wctx, k, v, 0).Err(); err == nil {
				mu.Lock()
				acked[k] = v
				mu.Unlock()
			}
		}
	})
	defer func() { stop(); wg.Wait() }()
	for round := range 4 {
		shards, err := c.Shards(ctx)
		if err != nil {
			t.Fatal(err)
		}
		old := shards[round%2].Master
		promoted, err := c.FailOver(ctx, old)
		if err != nil {
			t.Fatal(err)
		}
		if promoted == old {
			t.Fatalf("round %d: %s is still the master", round, old)
		}
		after, err := c.Shards(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range after {
			if s.Master == "" || len(s.Replicas) != 1 {
				t.Fatalf("round %d: shard %+v, want one master and one replica", round, s)
			}
		}
		mu.Lock()
		check := maps.Clone(acked)
		mu.Unlock()
		if len(check) == 0 {
			t.Fatalf("round %d: no write acknowledged", round)
		}
		for k, v := range check {
			if got, err := cc.Get(ctx, k).Result(); err != nil || got != v {
				t.Fatalf("round %d: acknowledged write %s=%s after failing %s over to %s: %q, %v", round, k, v, old, promoted, got, err)
			}
		}
		t.Logf("round %d: %d acknowledged writes all there", round, len(check))
	}
}
