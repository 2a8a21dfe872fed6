//go:build unix

package redisnx_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/rediscluster"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestClusterConformance runs the suite on a Redis Cluster of three masters
// with one replica each.
func TestClusterConformance(t *testing.T) {
	t.Parallel()
	c := rediscluster.Start(t, rediscluster.Options{})
	client := c.Client(t, redis.ClusterOptions{})
	deduptest.RunLease(t, deduptest.LeaseHarness{
		New: func(t testing.TB, cfg deduptest.Config) deduptest.LeaseInstance {
			s, err := redisnx.New(client, redisnx.Options{Lease: cfg.Lease, TTL: cfg.TTL, Prefix: testenv.Name("redisnx")})
			if err != nil {
				t.Fatal(err)
			}
			return deduptest.LeaseInstance{Store: s}
		},
		Down: func(t testing.TB) dedup.LeaseStore {
			dead := redis.NewClusterClient(&redis.ClusterOptions{
				Addrs:       []string{testenv.DeadAddr(t)},
				DialTimeout: 200 * time.Millisecond,
				MaxRetries:  -1,
			})
			t.Cleanup(func() { _ = dead.Close() })
			s, err := redisnx.New(dead, redisnx.Options{Prefix: testenv.Name("redisnx")})
			if err != nil {
				t.Fatal(err)
			}
			return s
		},
	})
}

// shardLoad claims and completes fresh keys on every shard of a cluster,
// with a few workers per shard, and keeps count.
type shardLoad struct {
	s      *redisnx.Store
	client *redis.ClusterClient
	shards []rediscluster.Shard

	// victim gates the workers of one shard: they hold it for reading
	// during each claim and complete, so taking it for writing waits until
	// none of that shard's writes is in flight and holds them back
	// (victimShard -1: no shard).
	victim      sync.RWMutex
	victimShard int

	ok        []atomic.Int64 // completed marks, per shard
	failed    []atomic.Int64 // claims or completes that returned an error, per shard
	firstOK   []atomic.Int64 // unix nanoseconds of the first completion after arm, per shard
	armed     atomic.Bool
	mu        sync.Mutex
	completed []dedup.Key
	wrong     []string // answers that must never happen on fresh keys
}

// newClusterLoad starts a cluster of three masters with one replica each,
// whose replicas do not take over on their own
// (cluster-replica-no-failover), and returns it with a shardLoad on a Store
// on a client with clientOpts.
func newClusterLoad(t *testing.T, clientOpts redis.ClusterOptions) (*rediscluster.Cluster, *shardLoad) {
	t.Helper()
	c := rediscluster.Start(t, rediscluster.Options{Args: []string{"--cluster-replica-no-failover", "yes"}})
	client := c.Client(t, clientOpts)
	s, err := redisnx.New(client, redisnx.Options{Prefix: testenv.Name("redisnx")})
	if err != nil {
		t.Fatal(err)
	}
	shards, err := c.Shards(testenv.Ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	return c, &shardLoad{s: s, client: client, shards: shards, victimShard: -1,
		ok: make([]atomic.Int64, len(shards)), failed: make([]atomic.Int64, len(shards)), firstOK: make([]atomic.Int64, len(shards))}
}

// key returns a fresh key whose slot the shard owns.
func (l *shardLoad) key(shard int) dedup.Key {
	for {
		k := dedup.NewKey("cluster/load", testenv.UniqueID("m"), []byte("payload"))
		if l.shards[shard].Owns(slot(l.s.RedisKey(k))) {
			return k
		}
	}
}

func (l *shardLoad) worker(ctx context.Context, shard int) {
	for ctx.Err() == nil {
		k := l.key(shard)
		if shard == l.victimShard {
			l.victim.RLock()
		}
		err := l.once(ctx, k)
		if shard == l.victimShard {
			l.victim.RUnlock()
		}
		if err != nil {
			if ctx.Err() == nil {
				l.failed[shard].Add(1)
			}
			continue
		}
		l.ok[shard].Add(1)
		if l.armed.Load() {
			l.firstOK[shard].CompareAndSwap(0, time.Now().UnixNano())
		}
	}
}

// once claims and completes k. A store error returns the error; a claim
// answered as a duplicate or in flight (impossible for a fresh key) is
// recorded as wrong.
func (l *shardLoad) once(ctx context.Context, k dedup.Key) error {
	lease, err := l.s.Claim(ctx, k)
	if err != nil {
		if errors.Is(err, dedup.ErrDuplicate) || errors.Is(err, dedup.ErrInFlight) || errors.Is(err, dedup.ErrFingerprintMismatch) {
			l.mu.Lock()
			l.wrong = append(l.wrong, fmt.Sprintf("fresh key %s: %v", k, err))
			l.mu.Unlock()
		}
		return err
	}
	if err := l.s.Complete(ctx, lease, nil); err != nil {
		return err
	}
	l.mu.Lock()
	l.completed = append(l.completed, k)
	l.mu.Unlock()
	return nil
}

// waitFor waits, up to a generous bound, until cond holds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	bound := time.NewTimer(30 * time.Second)
	defer bound.Stop()
	for !cond() {
		select {
		case <-tick.C:
		case <-bound.C:
			t.Fatalf("not within 30s: %s", what)
		}
	}
}

// TestClusterMasterKilledUnderLoad kills a master of a three-shard cluster
// while workers claim and complete fresh keys on every shard. The replica
// is held back from taking over (cluster-replica-no-failover) until the
// healthy shards have shown that they keep serving with the master down;
// then it is let go. The client keeps its slot map for an hour unless told
// otherwise. Checked: the dead shard's claims fail (never a false answer)
// while it has no master, the healthy shards' claims keep succeeding, the
// dead shard's claims succeed again after the promotion, and every
// completed mark is still there at the end.
func TestClusterMasterKilledUnderLoad(t *testing.T) {
	t.Parallel()
	c, l := newClusterLoad(t, redis.ClusterOptions{ClusterStateReloadInterval: time.Hour})
	s, shards, ctx := l.s, l.shards, testenv.Ctx(t)
	const victim, perShard = 0, 4
	l.victimShard = victim
	healthy := func() (n int64) {
		for i := range shards {
			if i != victim {
				n += l.ok[i].Load()
			}
		}
		return n
	}

	loadCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { stop(); wg.Wait() }()
	for i := range shards {
		for range perShard {
			wg.Go(func() { l.worker(loadCtx, i) })
		}
	}
	started := time.Now()
	waitFor(t, "50 completed marks on every shard", func() bool {
		for i := range shards {
			if l.ok[i].Load() < 50 {
				return false
			}
		}
		return true
	})
	beforeRate := float64(healthy()) / time.Since(started).Seconds()

	// Kill the victim's master once its replica has every acknowledged
	// write (Redis replicates asynchronously: a write in the last moment
	// before a kill may be lost, which is Redis's limit, not the Store's).
	l.victim.Lock()
	dead := shards[victim].Master
	if err := c.WaitInSync(ctx, dead); err != nil {
		l.victim.Unlock()
		t.Fatal(err)
	}
	if err := c.Kill(dead); err != nil {
		l.victim.Unlock()
		t.Fatal(err)
	}
	killed := time.Now()
	victimOK, healthyAtKill := l.ok[victim].Load(), healthy()
	l.victim.Unlock()

	waitFor(t, "200 completed marks on the healthy shards with a master down", func() bool {
		return healthy()-healthyAtKill >= 200 && l.failed[victim].Load() > 0
	})
	outage := time.Since(killed)
	duringRate := float64(healthy()-healthyAtKill) / outage.Seconds()
	if n := l.ok[victim].Load(); n != victimOK {
		t.Fatalf("%d marks completed on the shard whose master is dead and not yet replaced", n-victimOK)
	}
	t.Logf("healthy shards: %.0f marks/s before the kill, %.0f marks/s in the %.1fs with the master down (%d errors on the dead shard meanwhile)",
		beforeRate, duringRate, outage.Seconds(), l.failed[victim].Load())

	// Let the replica take over, and see the dead shard's claims resume.
	l.armed.Store(true)
	replica := shards[victim].Replicas[0]
	if err := c.ConfigSet(ctx, replica, "cluster-replica-no-failover", "no"); err != nil {
		t.Fatal(err)
	}
	slot0 := int(shards[victim].Slots[0].Start)
	promoted, err := c.WaitMaster(ctx, slot0, dead)
	if err != nil {
		t.Fatal(err)
	}
	seen := time.Now()
	waitFor(t, "a completed mark on the failed-over shard", func() bool { return l.firstOK[victim].Load() != 0 })
	resumed := time.Unix(0, l.firstOK[victim].Load())
	t.Logf("%s took over from %s; the shard's first completed mark came %.2fs after the promotion was seen (%.1fs after the kill)",
		promoted, dead, resumed.Sub(seen).Seconds(), resumed.Sub(killed).Seconds())
	stop()
	wg.Wait()

	l.mu.Lock()
	defer l.mu.Unlock()
	for _, w := range l.wrong {
		t.Error(w)
	}
	// Every completed mark is still there: a claim of it is a duplicate.
	lost := 0
	for start := 0; start < len(l.completed); start += 500 {
		keys := l.completed[start:min(start+500, len(l.completed))]
		res, err := s.ClaimBatch(ctx, keys)
		if err != nil {
			t.Fatalf("ClaimBatch of completed keys: %v", err)
		}
		for i, r := range res {
			if !errors.Is(r.Err, dedup.ErrDuplicate) {
				lost++
				if lost <= 5 {
					t.Errorf("completed key %s claimed again: %+v", keys[i], r)
				}
			}
		}
	}
	t.Logf("%d completed marks checked, %d lost", len(l.completed), lost)
	if lost > 0 {
		t.Fatalf("%d of %d completed marks lost", lost, len(l.completed))
	}
}

// sentHook calls sent the first time the client sends a command (alone or
// in a pipeline) that names key.
type sentHook struct {
	key  string
	once sync.Once
	sent chan struct{}
}

func (h *sentHook) saw(cmds []redis.Cmder) {
	for _, cmd := range cmds {
		for _, a := range cmd.Args() {
			if a == h.key {
				h.once.Do(func() { close(h.sent) })
				return
			}
		}
	}
}

func (h *sentHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *sentHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.saw([]redis.Cmder{cmd})
		return next(ctx, cmd)
	}
}
func (h *sentHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.saw(cmds)
		return next(ctx, cmds)
	}
}

// TestClusterFrozenMasterDelaysOnlyItsKeys: while a claim waits on a master
// that answers nothing (SIGSTOP), claims and completes of keys on the other
// masters go through: the Store's group commit does not make them wait
// for the frozen node.
func TestClusterFrozenMasterDelaysOnlyItsKeys(t *testing.T) {
	t.Parallel()
	// Long timeouts: the frozen node's claim stays in flight until the
	// node is resumed.
	c, l := newClusterLoad(t, redis.ClusterOptions{ReadTimeout: 2 * time.Minute, WriteTimeout: 2 * time.Minute})
	s, shards, ctx, client := l.s, l.shards, testenv.Ctx(t), l.client
	for i := range shards { // connections to every master
		if _, err := s.Claim(ctx, l.key(i)); err != nil {
			t.Fatal(err)
		}
	}

	frozen := l.key(0)
	hook := &sentHook{key: s.RedisKey(frozen), sent: make(chan struct{})}
	client.AddHook(hook)
	if err := c.Pause(ctx, shards[0].Master); err != nil {
		t.Fatal(err)
	}
	resumed := false
	defer func() {
		if !resumed {
			_ = c.Resume(context.Background(), shards[0].Master)
		}
	}()
	frozenDone := make(chan error, 1)
	go func() {
		_, err := s.Claim(ctx, frozen)
		frozenDone <- err
	}()
	select {
	case <-hook.sent:
	case err := <-frozenDone:
		t.Fatalf("the claim on the frozen master returned %v before it was sent", err)
	}

	for i := 1; i < len(shards); i++ {
		for range 10 {
			k := l.key(i)
			lease, err := s.Claim(ctx, k)
			if err != nil {
				t.Fatalf("claim on a healthy master while another is frozen: %v", err)
			}
			if err := s.Complete(ctx, lease, nil); err != nil {
				t.Fatalf("complete on a healthy master while another is frozen: %v", err)
			}
		}
	}
	select {
	case err := <-frozenDone:
		t.Fatalf("the claim on the frozen master returned (%v) before the healthy masters' claims: they waited for it", err)
	default:
	}

	resumed = true
	if err := c.Resume(ctx, shards[0].Master); err != nil {
		t.Fatal(err)
	}
	if err := <-frozenDone; err != nil {
		t.Fatalf("the claim on the resumed master: %v", err)
	}
}
