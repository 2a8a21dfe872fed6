package redisnx

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func BenchmarkProbe(b *testing.B) {
	c := testenv.Redis(b)
	ctx := context.Background()
	prefix := testenv.Name("probe")
	var n atomic.Int64
	key := func() string { return prefix + ":" + strconv.FormatInt(n.Add(1), 10) }
	b.Run("bare", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := c.SetNX(ctx, key(), "1", 30*time.Second).Err(); err != nil {
					b.Fatal(err)
				}
			}
		})
	})
	b.Run("bare2", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				k := key()
				if err := c.SetNX(ctx, k, "1", 30*time.Second).Err(); err != nil {
					b.Fatal(err)
				}
				if err := c.SetNX(ctx, k+"x", "1", 30*time.Second).Err(); err != nil {
					b.Fatal(err)
				}
			}
		})
	})
	s, _ := New(c, Options{Prefix: prefix + "s"})
	b.Run("rawproto", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				k := s.prefix + key()
				tok := newToken()
				rec := inFlightRecord(dedup.Fingerprint{}, tok)
				_, _ = c.Pipelined(ctx, func(p redis.Pipeliner) error {
					p.Do(ctx, "set", k, rec, "px", s.leaseArg, "nx", "get")
					p.Get(ctx, k+"old")
					return nil
				})
				if err := completeScript.EvalSha(ctx, c, []string{k}, tok, []byte("ok"), s.ttlArg).Err(); err != nil {
					b.Fatal(err)
				}
			}
		})
	})
	for _, skip := range []bool{false, true} {
		s, _ := New(c, Options{Prefix: prefix + "i", SkipPreviousLayout: skip})
		b.Run("idem-skip="+strconv.FormatBool(skip), func(b *testing.B) {
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					k := dedup.Key{Scope: "bench", ID: key()}
					l, err := s.Claim(ctx, k)
					if err == nil {
						err = s.Complete(ctx, l, []byte("ok"))
					}
					if err != nil {
						b.Fatal(err)
					}
				}
			})
		})
	}
}
