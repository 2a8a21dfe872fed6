//go:build unix

package redisnx_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// uuid returns a random UUID in its 36-character text form.
func uuid() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// usedMemory is INFO memory's used_memory.
func usedMemory(ctx context.Context, t testing.TB, c *redis.Client) int64 {
	t.Helper()
	info, err := c.Info(ctx, "memory").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no used_memory in %q", info)
	return 0
}

// TestMarkMemory measures the Redis memory of done marks (default prefix,
// no result) against a bare SET <uuid> 1 EX 86400, on a Redis of its own, in
// the same run: 100,000 of each, used_memory before and after. A done mark
// without fingerprint must stay within 160 bytes; the figures are logged.
func TestMarkMemory(t *testing.T) {
	t.Parallel()
	const n = 100_000
	srv, err := fault.StartRedis(context.Background(), fault.RedisOptions{})
	switch {
	case err != nil && strings.Contains(err.Error(), "not found"):
		testenv.Unavailable(t, fmt.Sprintf("a throwaway redis-server: %v", err))
	case err != nil:
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	perKey := func(name string, write func()) float64 {
		t.Helper()
		if err := c.FlushAll(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		before := usedMemory(ctx, t, c)
		write()
		if got := c.DBSize(ctx).Val(); got != n {
			t.Fatalf("%s: %d keys, want %d", name, got, n)
		}
		b := float64(usedMemory(ctx, t, c)-before) / n
		t.Logf("%s: %.1f bytes of used_memory per key", name, b)
		return b
	}

	bare := perKey("SET <uuid> 1 EX 86400", func() {
		for done := 0; done < n; done += 1000 {
			if _, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
				for range 1000 {
					p.Set(ctx, uuid(), "1", 24*time.Hour)
				}
				return nil
			}); err != nil {
				t.Fatal(err)
			}
		}
	})
	s, err := redisnx.New(c, redisnx.Options{})
	if err != nil {
		t.Fatal(err)
	}
	marks := func(fingerprint bool) func() {
		return func() {
			for done := 0; done < n; done += 1000 {
				keys := make([]dedup.Key, 1000)
				for i := range keys {
					keys[i] = dedup.Key{Scope: "billing/charge", ID: uuid()}
					if fingerprint {
						keys[i].Fingerprint = dedup.FingerprintOf([]byte(keys[i].ID))
					}
				}
				res, err := s.ClaimBatch(ctx, keys)
				if err != nil {
					t.Fatal(err)
				}
				// Complete from a few goroutines at once, so the
				// completes share pipelines.
				var wg sync.WaitGroup
				errs := make(chan error, len(res))
				const workers = 50
				for w := range workers {
					wg.Go(func() {
						for i := w; i < len(res); i += workers {
							if res[i].Err != nil {
								errs <- res[i].Err
								return
							}
							if err := s.Complete(ctx, res[i].Lease, nil); err != nil {
								errs <- err
								return
							}
						}
					})
				}
				wg.Wait()
				close(errs)
				for err := range errs {
					t.Fatal(err)
				}
			}
		}
	}
	mark := perKey("done mark", marks(false))
	k := dedup.Key{Scope: "billing/charge", ID: uuid()}
	l, err := s.Claim(ctx, k)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(ctx, l, nil); err != nil {
		t.Fatal(err)
	}
	if v := c.Get(ctx, s.RedisKey(k)).Val(); v != "1" {
		t.Fatalf("a done mark without fingerprint and result holds %q, want %q", v, "1")
	}
	withFP := perKey("done mark with fingerprint", marks(true))
	t.Logf("bare SET %.1f, done mark %.1f (+%.1f), with fingerprint %.1f bytes per key", bare, mark, mark-bare, withFP)
	if mark > 160 {
		t.Fatalf("a done mark takes %.1f bytes of used_memory, more than 160 (bare SET: %.1f)", mark, bare)
	}
}
