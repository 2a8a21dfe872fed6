//go:build unix

package redisnx_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// startDurableRedis starts a throwaway redis-server that writes every
// change to its append-only file and fsyncs it before answering
// (appendonly yes, appendfsync always): a SIGKILL loses no acknowledged
// write, and a restart reloads them.
func startDurableRedis(t *testing.T) *fault.Redis {
	t.Helper()
	srv, err := fault.StartRedis(context.Background(), fault.RedisOptions{
		Args: []string{"--appendonly", "yes", "--appendfsync", "always"},
	})
	switch {
	case err != nil && strings.Contains(err.Error(), "not found"):
		testenv.Unavailable(t, fmt.Sprintf("a throwaway redis-server: %v", err))
	case err != nil:
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	return srv
}

// TestKilledRedisNeverAnswersLeaseLostToItsOwner: twelve clients claim a
// few keys and complete or release each lease they get, while a durable
// Redis is SIGKILLed and restarted twelve times, with go-redis's default
// retries. A lease runs far longer than the test, and the Redis loses no
// acknowledged write, so an owner's lease is never lost: only its own
// Complete or Release ends it. An owner that hears dedup.ErrLeaseLost
// heard the effect of its own earlier attempt (a call run twice), a wrong
// answer where the truth was unknown. Calls whose reply was lost must
// answer dedup.ErrOutcomeUnknown (or another error), never lease lost.
func TestKilledRedisNeverAnswersLeaseLostToItsOwner(t *testing.T) {
	t.Parallel()
	srv := startDurableRedis(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	const lease = time.Minute
	s, err := redisnx.New(c, redisnx.Options{Lease: lease, TTL: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx := testenv.Ctx(t)

	// The keys of an epoch; each restart starts a new epoch, so the keys
	// whose claim's reply was lost (held until their lease runs out) do
	// not stop the work.
	var epoch atomic.Int32
	const keysPerEpoch, clients, kills = 4, 12, 12
	var (
		mu      sync.Mutex
		wrong   []string
		counts  = map[string]int{}
		granted atomic.Int64
	)
	count := func(what string) {
		mu.Lock()
		counts[what]++
		mu.Unlock()
	}
	classify := func(err error) string {
		switch {
		case err == nil:
			return "ok"
		case errors.Is(err, dedup.ErrOutcomeUnknown):
			return "unknown"
		case errors.Is(err, dedup.ErrLeaseLost):
			return "lease lost"
		default:
			return "error"
		}
	}

	loadCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			for loadCtx.Err() == nil {
				k := dedup.Key{Scope: "killed", ID: fmt.Sprintf("e%d-k%d", epoch.Load(), rand.IntN(keysPerEpoch))}
				l, err := s.Claim(loadCtx, k)
				if err != nil {
					continue
				}
				granted.Add(1)
				name, call := "release", func() error { return s.Release(ctx, l) }
				if rand.IntN(2) == 0 {
					name, call = "complete", func() error { return s.Complete(ctx, l, nil) }
				}
				err = call()
				what := classify(err)
				count(name + " " + what)
				if what == "lease lost" {
					mu.Lock()
					wrong = append(wrong, fmt.Sprintf("%s of %s by its owner (token %s): %v", name, k, l.Token, err))
					mu.Unlock()
				}
			}
		})
	}
	waitGranted := func(n int64) {
		testenv.Eventually(t, 30*time.Second, fmt.Sprintf("%d leases granted", n), func() bool { return granted.Load() >= n })
	}
	for i := range kills {
		waitGranted(granted.Load() + 25)
		if err := srv.Kill(); err != nil {
			t.Fatal(err)
		}
		if err := srv.Restart(ctx); err != nil {
			t.Fatal(err)
		}
		epoch.Store(int32(i + 1))
	}
	waitGranted(granted.Load() + 25)
	stop()
	wg.Wait()

	mu.Lock()
	defer mu.Unlock()
	t.Logf("%d leases granted across %d kills; outcomes: %v", granted.Load(), kills, counts)
	for _, w := range wrong {
		t.Error(w)
	}
}
