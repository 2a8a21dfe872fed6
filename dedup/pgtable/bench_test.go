package pgtable_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// BenchmarkClaimTx compares a bare business transaction (BEGIN, one INSERT,
// COMMIT) with the same transaction plus idem's claim, in the same run.
//
//	go test -run '^$' -bench 'ClaimTx|ClaimBatch' -benchtime 5s -count 3 ./dedup/pgtable/
func BenchmarkClaimTx(b *testing.B) {
	b.Run("durable", func(b *testing.B) { benchClaimTx(b, testenv.Pool(b, 16)) })
	// With synchronous_commit off the commit does not wait for the disk,
	// so round trips dominate and the claim's cost shows plainly.
	b.Run("async_commit", func(b *testing.B) {
		benchClaimTx(b, testenv.PoolWith(b, 16, map[string]string{"synchronous_commit": "off"}))
	})
}

func benchClaimTx(b *testing.B, pool *pgxpool.Pool) {
	s := newStore(b, pool, pgtable.Options{})
	ctx := context.Background()
	orders := pgx.Identifier{s.Options().Schema, "orders"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+orders+" (id text PRIMARY KEY, amount bigint NOT NULL)"); err != nil {
		b.Fatal(err)
	}
	insert := "INSERT INTO " + orders + " (id, amount) VALUES ($1, $2)"
	var seq atomic.Int64
	next := func(prefix string) string { return prefix + strconv.FormatInt(seq.Add(1), 10) }

	b.Run("bare", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, insert, next("bare-"), 100)
					return err
				})
				if err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "tx/s")
	})
	b.Run("idem", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				id := next("idem-")
				_, err := s.Process(ctx, dedup.Key{Scope: "bench", ID: id}, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
					_, err := tx.Exec(ctx, insert, id, 100)
					return nil, err
				})
				if err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "tx/s")
	})
}

// BenchmarkClaimBatch claims 1000 new ids per transaction with ClaimBatchTx,
// beside a bare unnest insert of 1000 rows into a table of the same shape.
func BenchmarkClaimBatch(b *testing.B) {
	const batch = 1000
	pool := testenv.Pool(b, 4)
	s := newStore(b, pool, pgtable.Options{})
	ctx := context.Background()
	bare := pgx.Identifier{s.Options().Schema, "bare_seen"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+bare+" (scope text, id text, fingerprint bytea, PRIMARY KEY (scope, id))"); err != nil {
		b.Fatal(err)
	}
	var seq atomic.Int64
	makeKeys := func() []dedup.Key {
		keys := make([]dedup.Key, batch)
		base := seq.Add(batch)
		for i := range keys {
			keys[i] = dedup.NewKey("bench", "evt-"+strconv.FormatInt(base+int64(i), 10), []byte("payload"))
		}
		return keys
	}
	b.Run("bare", func(b *testing.B) {
		for b.Loop() {
			keys := makeKeys()
			scopes, ids, fps := make([]string, batch), make([]string, batch), make([][]byte, batch)
			for i, k := range keys {
				scopes[i], ids[i], fps[i] = k.Scope, k.ID, k.Fingerprint.Bytes()
			}
			_, err := pool.Exec(ctx, "INSERT INTO "+bare+" SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[]) ON CONFLICT DO NOTHING", scopes, ids, fps)
			if err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "ids/s")
	})
	b.Run("idem", func(b *testing.B) {
		for b.Loop() {
			keys := makeKeys()
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				res, err := s.ClaimBatchTx(ctx, tx, keys)
				if err != nil {
					return err
				}
				for _, r := range res {
					if r != nil {
						return r
					}
				}
				return nil
			})
			if err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "ids/s")
	})
}

// BenchmarkCleanup times Cleanup on a table of b.N expired rows scattered
// among live ones (expired_50pct: as many live rows as expired ones;
// expired_10pct and expired_1pct: 9 and 99 times as many), with expiries
// spread over two days and rows in random order, and reports the rows it
// deletes per second. Compare with the rate claims insert rows, in the same
// run:
//
//	go test -run '^$' -bench 'Cleanup' -benchtime 10000x ./dedup/pgtable/ && \
//	go test -run '^$' -bench 'ClaimBatch|ClaimTx/durable' -benchtime 3s ./dedup/pgtable/
func BenchmarkCleanup(b *testing.B) {
	for _, c := range []struct {
		name string
		live int // live rows per expired row
	}{{"expired_50pct", 1}, {"expired_10pct", 9}, {"expired_1pct", 99}} {
		b.Run(c.name, func(b *testing.B) { benchCleanup(b, c.live) })
	}
}

func benchCleanup(b *testing.B, live int) {
	pool := testenv.Pool(b, 2)
	s := newStore(b, pool, pgtable.Options{})
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `INSERT INTO `+s.Table()+` (key, fingerprint, expires_at)
		SELECT `+pgtable.KeySQL("'bench'", "md5(g::text)")+`, '\x00',
		       CASE WHEN g % $2::int = 0 THEN now() - random() * interval '1 day' ELSE now() + interval '1 hour' + random() * interval '1 day' END
		FROM generate_series(1, $1::int * $2::int) g ORDER BY random()`, b.N, live+1); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE "+s.Table()); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	n, err := s.Cleanup(ctx)
	b.StopTimer()
	if err != nil || n != int64(b.N) {
		b.Fatalf("Cleanup = %d, %v; want %d rows", n, err, b.N)
	}
	b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "rows/s")
}
