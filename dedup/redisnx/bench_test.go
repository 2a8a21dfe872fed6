package redisnx_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// BenchmarkLease compares, in one run and with the same shape (parallel
// workers, one unique message each time), the bare client's SET NX PX with
// a full idem lease (Claim, then Complete), and measures pipelined batch
// claims.
//
//	go test -run XXX -bench . -benchtime 3s -count 3 ./dedup/redisnx/
func BenchmarkLease(b *testing.B) {
	b.Run("bare", func(b *testing.B) {
		c := testenv.Redis(b)
		prefix := testenv.Name("bench_bare")
		b.Cleanup(func() { deletePrefix(b, c, prefix) })
		ctx := context.Background()
		var n atomic.Int64
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				key := prefix + ":" + strconv.FormatInt(n.Add(1), 10)
				if err := c.SetNX(ctx, key, "1", 30*time.Second).Err(); err != nil {
					b.Error(err)
					return
				}
			}
		})
		reportOps(b)
	})

	b.Run("idem", func(b *testing.B) {
		s, _ := newStore(b, redisnx.Options{Prefix: testenv.Name("bench_idem")})
		ctx := context.Background()
		scope := testenv.UniqueID("bench")
		result := []byte("ok")
		var n atomic.Int64
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				key := dedup.Key{Scope: scope, ID: strconv.FormatInt(n.Add(1), 10)}
				l, err := s.Claim(ctx, key)
				if err == nil {
					err = s.Complete(ctx, l, result)
				}
				if err != nil {
					b.Error(err)
					return
				}
			}
		})
		reportOps(b)
	})

	b.Run("batch", func(b *testing.B) {
		const batch = 1000
		s, _ := newStore(b, redisnx.Options{Prefix: testenv.Name("bench_batch")})
		ctx := context.Background()
		scope := testenv.UniqueID("bench")
		keys := make([]dedup.Key, batch)
		var n int64
		b.ResetTimer()
		for b.Loop() {
			for i := range keys {
				n++
				keys[i] = dedup.Key{Scope: scope, ID: strconv.FormatInt(n, 10)}
			}
			res, err := s.ClaimBatch(ctx, keys)
			if err != nil {
				b.Fatal(err)
			}
			if res[batch-1].Err != nil {
				b.Fatal(res[batch-1].Err)
			}
		}
		b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "keys/s")
	})
}

func reportOps(b *testing.B) {
	if s := b.Elapsed().Seconds(); s > 0 {
		b.ReportMetric(float64(b.N)/s, "ops/s")
	}
}
