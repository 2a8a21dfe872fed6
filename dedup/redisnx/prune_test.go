//go:build unix

package redisnx

import (
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/testkit/rediscluster"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestNodeGroupsShrink: on a real Redis Cluster, the per-master groups of a
// master that left the topology (killed, its replica promoted) are dropped
// at the next look, while the live masters' groups stay; groups that no
// call used for nodeIdle are dropped too; and a dropped master's next call
// starts new groups and succeeds. The Store's clock is moved by hand.
func TestNodeGroupsShrink(t *testing.T) {
	t.Parallel()
	c := rediscluster.Start(t, rediscluster.Options{})
	client := c.Client(t, redis.ClusterOptions{})
	s, err := New(client, Options{Prefix: testenv.Name("redisnx"), FailoverWait: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	s.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	setClock := func(d time.Duration) {
		mu.Lock()
		now = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).Add(d)
		mu.Unlock()
	}
	s.nodesMu.Lock()
	s.pruneAt = now.Add(nodeIdle)
	s.nodesMu.Unlock()
	// A look at the topology runs beside the call that starts it: the
	// checks below wait for it to end.
	looked := make(chan struct{}, 1)
	s.pruned = func() { looked <- struct{}{} }
	waitLook := func() {
		t.Helper()
		select {
		case <-looked:
		case <-time.After(2 * pruneTimeout):
			t.Fatal("no look at the topology ended")
		}
	}

	ctx := testenv.Ctx(t)
	shards, err := c.Shards(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Fresh keys of every shard, found through the client's slot map.
	keys := make([][]dedup.Key, len(shards))
	for i, sh := range shards {
		for len(keys[i]) < 8 {
			k := dedup.NewKey("prune", testenv.UniqueID("m"), nil)
			m, err := client.MasterForKey(ctx, s.RedisKey(k))
			if err != nil {
				t.Fatal(err)
			}
			if m.Options().Addr == sh.Master {
				keys[i] = append(keys[i], k)
			}
		}
	}
	claim := func(shard int) {
		t.Helper()
		k := keys[shard][0]
		keys[shard] = keys[shard][1:]
		if _, err := s.Claim(ctx, k); err != nil {
			t.Fatalf("claim on shard %d: %v", shard, err)
		}
	}
	groups := func() []string {
		s.nodesMu.Lock()
		defer s.nodesMu.Unlock()
		return slices.Sorted(maps.Keys(s.nodes))
	}
	want := func(what string, addrs ...string) {
		t.Helper()
		if got := groups(); !slices.Equal(got, slices.Sorted(slices.Values(addrs))) {
			t.Fatalf("%s: groups of %q, want %q", what, got, slices.Sorted(slices.Values(addrs)))
		}
	}

	// Half a minute before the first look: the groups made now are not
	// idle at that look.
	setClock(nodeIdle - 30*time.Second)
	for i := range shards {
		claim(i)
	}
	want("a claim on every shard", shards[0].Master, shards[1].Master, shards[2].Master)

	dead := shards[0].Master
	if err := c.WaitInSync(ctx, dead); err != nil {
		t.Fatal(err)
	}
	if err := c.Kill(dead); err != nil {
		t.Fatal(err)
	}
	promoted, err := c.WaitMaster(ctx, int(shards[0].Slots[0].Start), dead)
	if err != nil {
		t.Fatal(err)
	}
	// The Store looks at the topology through any node: wait until none
	// of them names the killed master any more.
	if err := c.WaitAgreed(ctx, int(shards[0].Slots[0].Start), promoted); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the client's slot map names the promoted master", func() bool {
		client.ReloadState(ctx)
		m, err := client.MasterForKey(ctx, s.RedisKey(keys[0][0]))
		return err == nil && m.Options().Addr == promoted
	})
	claim(0)
	want("the killed master's groups before the next look", dead, promoted, shards[1].Master, shards[2].Master)

	// A moment before the first look, every live master is used; at the
	// look, only the killed one, no longer in the topology, is dropped (it
	// was last used 30s before: not idle).
	setClock(nodeIdle - time.Second)
	for i := range shards {
		claim(i)
	}
	setClock(nodeIdle)
	claim(1)
	waitLook()
	want("after the look at the topology", promoted, shards[1].Master, shards[2].Master)

	// One look later, the masters unused for nodeIdle are dropped.
	setClock(2 * nodeIdle)
	claim(1)
	waitLook()
	want("after the look for idle groups", shards[1].Master)

	// A dropped master's next call starts new groups.
	claim(0)
	claim(2)
	want("calls after the drops", promoted, shards[1].Master, shards[2].Master)
}
